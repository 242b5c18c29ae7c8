//! Runs the agent on its own, e.g. to try it by hand:
//!
//! ```text
//! CORDON_AGENT_FD=3 CORDON_AGENT_CONFIG='{"sandbox_id":"x","default_user":"root","workdir":null,"env":[]}' \
//!     cordon-agent 3<>socket-opened-by-the-caller
//! ```
//! (The `cordon` binary normally execs itself under this name.)

fn main() {
    cordon_agent::main()
}
