//! `cordon kill ID...`: ends sandboxes of a running `cordon serve` (`DELETE /sandboxes/{id}`),
//! running or paused. Each id is tried: one that fails is a line on stderr and exit 1, the
//! others are still killed; each killed one's id is printed.

use anyhow::Result;
use clap::Args;
use hyper::Method;

use crate::api_client::{self, Api, ServerArgs};

#[derive(Args, Debug)]
pub struct KillArgs {
    /// The sandboxes' ids.
    #[arg(required = true, value_name = "ID")]
    ids: Vec<String>,
    #[command(flatten)]
    server: ServerArgs,
}

pub fn main(a: KillArgs) -> Result<u8> {
    let api = Api::new(&a.server)?;
    let rt = api_client::runtime()?;
    let mut failed = false;
    for id in &a.ids {
        let killed = api_client::check_id(id).and_then(|id| rt.block_on(api.json(Method::DELETE, &format!("/sandboxes/{id}"), None)));
        match killed {
            Ok(_) => println!("{id}"),
            // The server cannot be reached: every other id would say the same.
            Err(e) if e.downcast_ref::<api_client::Refused>().is_none() && e.downcast_ref::<crate::UsageError>().is_none() => return Err(e),
            Err(e) => {
                eprintln!("cordon kill: {id}: {}", crate::one_line(&e));
                failed = true;
            }
        }
    }
    Ok(u8::from(failed))
}
