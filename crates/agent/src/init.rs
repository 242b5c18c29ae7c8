//! `POST /init`: the host gives a running sandbox the sandbox-level environment of the create
//! that took it (envd's own `/init`, which E2B's orchestrator calls at boot and resume). A
//! sandbox started ahead of its create (a warm pool) gets its user's `envVars` this way. The
//! host's proxy never forwards this path from clients: it is the host's alone.

use std::collections::BTreeMap;
use std::sync::Arc;

use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};

use crate::body::{json, read_limited, Body};
use crate::Agent;

/// Largest body accepted: the environment a create may carry (see `cordon_spec`) with room.
const MAX_BODY: usize = 2 << 20;

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct InitBody {
    #[serde(default)]
    env_vars: BTreeMap<String, String>,
}

/// Merges `envVars` into the sandbox's environment: a name given replaces the image's value,
/// others are added; every later command sees them. 204, or 400 with the reason.
pub(crate) async fn handle(agent: Arc<Agent>, req: Request<Incoming>) -> Response<Body> {
    let bad = |m: String| json(StatusCode::BAD_REQUEST, &serde_json::json!({ "message": m }));
    let bytes = match read_limited(req.into_body(), MAX_BODY).await {
        Ok(b) => b,
        Err(e) => return bad(e.message),
    };
    let body: InitBody = match serde_json::from_slice(&bytes) {
        Ok(b) => b,
        Err(e) => return bad(format!("invalid init body: {e}")),
    };
    if let Some((k, _)) = body.env_vars.iter().find(|(k, v)| !crate::process_rpc::valid_env_key(k) || v.contains('\0')) {
        return bad(format!("invalid environment variable {k:?}"));
    }
    agent.merge_env(body.env_vars);
    Response::builder().status(StatusCode::NO_CONTENT).body(Body::empty()).unwrap_or_else(|_| Response::new(Body::empty()))
}

/// `base` with `add` merged in: a name already there takes the new value in place.
pub(crate) fn merged(mut base: Vec<(String, String)>, add: BTreeMap<String, String>) -> Vec<(String, String)> {
    for (k, v) in add {
        match base.iter_mut().find(|(b, _)| *b == k) {
            Some(slot) => slot.1 = v,
            None => base.push((k, v)),
        }
    }
    base
}

#[cfg(test)]
mod tests {
    #[test]
    fn given_names_replace_in_place_and_new_ones_follow() {
        let base = vec![("PATH".into(), "/bin".into()), ("A".into(), "1".into())];
        let add = [("A".to_string(), "2".to_string()), ("B".to_string(), "3".to_string())].into_iter().collect();
        let m = super::merged(base, add);
        assert_eq!(m, vec![("PATH".into(), "/bin".into()), ("A".into(), "2".into()), ("B".into(), "3".into())]);
    }
}
