//! Runs the agent on its own, for trying it by hand outside a sandbox. The caller binds and
//! listens on a Unix socket, passes it as descriptor 3, and sets
//! `CORDON_AGENT_FD=3` and `CORDON_AGENT_CONFIG_FD=4` with descriptor 4 holding the framed config
//! (`cordon_agent::encode_config`: a 4-byte little-endian length, then `{"sandbox_id":"x","default_user":"root","workdir":null,"env":[]}`).
//! Under `unshare --pid --fork` it runs as PID 1, as in a sandbox. (In cordon proper the
//! `cordon` binary execs itself under the name `cordon-agent` instead.)

fn main() {
    cordon_agent::main()
}
