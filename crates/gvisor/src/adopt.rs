//! gvisor sandboxes that outlive the process that made them (a server's restart): nothing of
//! one depends on its owner but the locks, pidfds and TUN descriptor the owner holds, and the
//! control connection to its link holder (see [`crate::holder`]), which serves the agent's
//! link itself. The next owner takes the run directory's lock back, opens a pidfd of `runsc
//! run` (checked to be in the sandbox's groups), reattaches the persistent TUN device in
//! runsc's network namespace, and connects to the holder.
//!
//! What the ledger's record does not say is in `gvisor.json` beside it, written before the
//! record says `keep`.

use std::io;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{holder, io_err, Gvisor, GvisorError, Sandbox};

const FACTS: &str = "gvisor.json";

/// What an adopter needs that the ledger's record does not hold.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Facts {
    networked: bool,
    key: String,
    default_user: String,
}

impl Facts {
    pub(crate) fn of(sb: &Sandbox) -> Facts {
        Facts { networked: sb.networked, key: sb.key.clone(), default_user: sb.default_user.clone() }
    }

    pub(crate) fn write(&self, dir: &Path) -> io::Result<()> {
        cordon_host::ledger::write_facts(dir, FACTS, self)
    }

    fn read(dir: &Path) -> io::Result<Facts> {
        cordon_host::ledger::read_facts(dir, FACTS)
    }
}

impl Gvisor {
    /// The ids of the sandboxes kept running by an owner that is gone.
    pub fn kept(&self) -> Vec<String> {
        self.ledger.kept().into_iter().map(|r| r.id).collect()
    }

    /// Takes back sandbox `id`, kept running by an owner that is gone, with its TUN's new
    /// descriptor when it has one. On an error it is left as it was, for [`Gvisor::reap_kept`].
    pub fn adopt(&self, id: &str) -> Result<(Sandbox, Option<std::os::fd::OwnedFd>), GvisorError> {
        let (entry, rec) = self.ledger.adopt(id).map_err(io_err(format!("adopt sandbox {id}")))?;
        let facts = Facts::read(entry.dir()).map_err(io_err(format!("read the facts of sandbox {id}")))?;
        let pid = rec.pid.ok_or_else(|| GvisorError::Setup(format!("sandbox {id} has no runsc on record")))?;
        let pidfd = cordon_host::sys::pidfd_open(pid).map_err(io_err(format!("pidfd_open the runsc of sandbox {id}")))?;
        // Opened, then checked: the pidfd names this process for good, and it is the sandbox's.
        if !rec.cgroup.holds(pid) {
            return Err(GvisorError::Setup(format!("sandbox {id}'s runsc (pid {pid}) is gone")));
        }
        let link = holder::Control::connect(entry.dir()).map_err(io_err(format!("connect to the link holder of sandbox {id}")))?;
        let tun = match facts.networked {
            true => Some(cordon_host::tun::reattach(pid).map_err(io_err(format!("take back the network link of sandbox {id}")))?),
            false => None,
        };
        let sb = Sandbox {
            id: id.to_string(),
            socket: entry.dir().join("agent.sock"),
            entry,
            held: rec.cgroup.pidfds(),
            cgroup: rec.cgroup,
            child: None,
            pid: Some(pid as u32),
            pidfd: Some(pidfd),
            link: Some(crate::Link::Holder(link)),
            holder: None,
            tun: None,
            networked: facts.networked,
            runsc: self.runsc.path.clone(),
            key: facts.key,
            torn_down: false,
            default_user: facts.default_user,
            keep: true,
        };
        Ok((sb, tun))
    }

    /// Whether sandbox `id` has a run directory (a live sandbox, or one not reaped yet).
    pub fn exists(&self, id: &str) -> bool {
        self.ledger.has(id)
    }

    /// Kills and removes the sandboxes kept running by an owner that is gone and not adopted.
    pub fn reap_kept(&self) -> usize {
        self.ledger.reap_kept()
    }
}

impl Sandbox {
    /// Lets go of a sandbox made with [`crate::SandboxConfig::keep`] without ending it: its
    /// lock is freed and its link holder waits for the next owner. Any other is destroyed, as
    /// a drop would.
    pub fn leave_running(mut self) {
        if self.keep && !self.torn_down && self.link.is_some() {
            self.torn_down = true;
        }
    }
}
