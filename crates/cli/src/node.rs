//! `cordon node ls | drain NAME | undrain NAME`: the nodes of a cluster, through any node's API
//! (`/cluster/v1/nodes`). A drain stops placement on the node at once (recorded in etcd, so it
//! outlasts the node's restarts) and then waits until the node's sandboxes have all ended.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use clap::{Args, Subcommand};
use hyper::Method;
use serde_json::Value;

use crate::api_client::{self, Api, ServerArgs};

#[derive(Args, Debug)]
pub struct NodeArgs {
    #[command(subcommand)]
    command: NodeCommand,
}

#[derive(Subcommand, Debug)]
enum NodeCommand {
    /// List the cluster's live nodes: name, URL, sandboxes, free memory, tiers, drained or not.
    Ls {
        #[command(flatten)]
        server: ServerArgs,
    },
    /// Place no new sandbox on NAME, then wait until its sandboxes have ended.
    Drain {
        name: String,
        /// Return once placement has stopped, without waiting for the sandboxes.
        #[arg(long)]
        no_wait: bool,
        /// Give up waiting after this long (e.g. 30m); the node stays drained.
        #[arg(long, value_name = "DURATION", default_value = "1h")]
        timeout: String,
        #[command(flatten)]
        server: ServerArgs,
    },
    /// Place sandboxes on NAME again.
    Undrain {
        name: String,
        #[command(flatten)]
        server: ServerArgs,
    },
}

/// How often a drain looks at the node's count of sandboxes.
const POLL: Duration = Duration::from_millis(500);

pub fn main(a: NodeArgs) -> Result<u8> {
    let server = match &a.command {
        NodeCommand::Ls { server } | NodeCommand::Drain { server, .. } | NodeCommand::Undrain { server, .. } => server,
    };
    let api = Api::new(server)?;
    let rt = api_client::runtime()?;
    match a.command {
        NodeCommand::Ls { .. } => {
            let nodes = rt.block_on(api.get("/cluster/v1/nodes"))?;
            println!("{:<20} {:<28} {:>9} {:>10}  {:<16} STATE", "NAME", "URL", "SANDBOXES", "FREE MEM", "TIERS");
            for n in nodes.as_array().into_iter().flatten() {
                let s = |k: &str| n.get(k).and_then(Value::as_str).unwrap_or("").to_string();
                let u = |k: &str| n.get(k).and_then(Value::as_u64).unwrap_or(0);
                let tiers: Vec<&str> = n.get("tiers").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
                let state = if n.get("draining").and_then(Value::as_bool).unwrap_or(false) { "draining" } else { "ready" };
                println!("{:<20} {:<28} {:>5}/{:<3} {:>7} MiB  {:<16} {state}", s("name"), s("url"), u("sandboxes"), u("maxSandboxes"), u("freeMemory") >> 20, tiers.join(","));
            }
            Ok(0)
        }
        NodeCommand::Undrain { name, .. } => {
            rt.block_on(api.json(Method::DELETE, &format!("/cluster/v1/nodes/{}/drain", check_name(&name)?), None))?;
            println!("{name}: placing sandboxes again");
            Ok(0)
        }
        NodeCommand::Drain { name, no_wait, timeout, .. } => {
            let timeout = cordon_spec::parse_duration(&timeout).map_err(|e| crate::usage(format!("--timeout: {}", e.reason)))?;
            let (marked, _) = rt.block_on(api.json(Method::POST, &format!("/cluster/v1/nodes/{}/drain", check_name(&name)?), None))?;
            eprintln!("{name}: no new sandboxes are placed there");
            if no_wait {
                return Ok(0);
            }
            // Only a count the node published after the drain was recorded says it is empty:
            // an older one may predate creates placed there just before.
            let drained_at = seq(&marked);
            let start = Instant::now();
            loop {
                let nodes = rt.block_on(api.get("/cluster/v1/nodes"))?;
                let node = nodes.as_array().into_iter().flatten().find(|n| n.get("name").and_then(Value::as_str) == Some(name.as_str()));
                let Some(node) = node else {
                    println!("{name}: drained (the node has left the cluster)");
                    return Ok(0);
                };
                let left = node.get("sandboxes").and_then(Value::as_u64).unwrap_or(0);
                if left == 0 && seq(node) > drained_at {
                    println!("{name}: drained");
                    return Ok(0);
                }
                if start.elapsed() >= timeout {
                    return Err(anyhow!("{name}: {left} sandbox(es) still running after {}; the node stays drained (run the command again to keep waiting)", a_duration(timeout)));
                }
                std::thread::sleep(POLL);
            }
        }
    }
}

fn check_name(name: &str) -> Result<&str> {
    if cordon_cluster::valid_node_name(name) {
        Ok(name)
    } else {
        Err(crate::usage(format!("{name:?} is not a node name: node names are 1 to 20 of a-z and 0-9")))
    }
}

/// A node's publication count, as `/cluster/v1/nodes` gives it.
fn seq(node: &Value) -> u64 {
    node.get("seq").and_then(Value::as_u64).unwrap_or(0)
}

fn a_duration(d: Duration) -> String {
    format!("{} s", d.as_secs())
}
