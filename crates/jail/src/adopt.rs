//! Sandboxes that outlive the process that made them: a server's restart (an upgrade, a crash,
//! `kill -9`) leaves them running, and the next server on the same state directory takes them
//! back with [`Jail::adopt`].
//!
//! Nothing of a running sandbox depends on its owner except what the owner holds open: the
//! run directory's lock, the uid slot's lock, the pidfd of the init, the TUN descriptor and the
//! audit listener. The init's stdio is `/dev/null` and its session its own, so the owner's end
//! does not signal it. The adopter takes the locks back (both were freed by the owner's end),
//! opens a new pidfd of the init (checked to be in the sandbox's groups, so a reused pid is
//! never taken for it), and attaches a new descriptor to the TUN device, which is persistent
//! (see `cordon_host::tun::reattach`). The audit listener cannot be taken back: the kernel
//! answers what the filter would have reported with ENOSYS instead of EPERM once it is closed,
//! so a denied syscall stays denied, but the adopter's audit trail starts empty and records
//! nothing more.
//!
//! What the ledger's record does not say (Landlock's result, the filter's settings, the
//! default user, whether there is a TUN) is in `jail.json` beside it, written before the record
//! says `keep`.

use std::io;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{io_err, landlock, sys, Jail, JailError, Sandbox};

const FACTS: &str = "jail.json";

/// What an adopter needs that the ledger's record does not hold.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Facts {
    landlock: Option<landlock::Enforced>,
    allow_ptrace: bool,
    /// Written by servers from before this field: read as a filter without notification.
    #[serde(default)]
    notifies: bool,
    connect_ports: Option<Vec<(u16, u16)>>,
    default_user: String,
    tun: bool,
    keeps_writable: bool,
}

impl Facts {
    pub(crate) fn of(sb: &Sandbox, tun: bool) -> Facts {
        Facts {
            landlock: sb.landlock,
            allow_ptrace: sb.allow_ptrace,
            notifies: sb.notifies,
            connect_ports: sb.connect_ports.clone(),
            default_user: sb.default_user.clone(),
            tun,
            keeps_writable: sb.keeps_writable,
        }
    }

    pub(crate) fn write(&self, dir: &Path) -> io::Result<()> {
        cordon_host::ledger::write_facts(dir, FACTS, self)
    }

    fn read(dir: &Path) -> io::Result<Facts> {
        cordon_host::ledger::read_facts(dir, FACTS)
    }
}

/// A sandbox taken back: the handle, and its TUN's new descriptor when it has one.
pub struct Adopted {
    pub sandbox: Sandbox,
    pub tun: Option<std::os::fd::OwnedFd>,
}

impl Jail {
    /// The ids of the sandboxes kept running by an owner that is gone: what [`Jail::adopt`]
    /// can take back.
    pub fn kept(&self) -> Vec<String> {
        self.ledger.kept().into_iter().map(|r| r.id).collect()
    }

    /// Takes back sandbox `id`, kept running by an owner that is gone (see the module's
    /// notes). On an error the sandbox is left as it was, for [`Jail::reap_kept`].
    pub fn adopt(&self, id: &str) -> Result<Adopted, JailError> {
        let (entry, rec) = self.ledger.adopt(id).map_err(io_err(format!("adopt sandbox {id}")))?;
        let facts = Facts::read(entry.dir()).map_err(io_err(format!("read the facts of sandbox {id}")))?;
        let slot = match rec.slot {
            Some(i) => Some(self.slots.claim(i).map_err(io_err(format!("take back the uid range of sandbox {id}")))?),
            None => None,
        };
        let pid = rec.pid.ok_or_else(|| JailError::Setup(format!("sandbox {id} has no init on record")))?;
        let pidfd = sys::pidfd_open(pid).map_err(io_err(format!("pidfd_open the init of sandbox {id}")))?;
        // Opened, then checked: the pidfd names this process for good, and it is the sandbox's.
        if !rec.cgroup.holds(pid) {
            return Err(JailError::Setup(format!("sandbox {id}'s init (pid {pid}) is gone")));
        }
        let tun = match facts.tun {
            true => Some(crate::tun::reattach(pid).map_err(io_err(format!("take back the network link of sandbox {id}")))?),
            false => None,
        };
        let mut sb = Sandbox {
            id: id.to_string(),
            socket: entry.dir().join("agent.sock"),
            entry,
            cgroup: rec.cgroup,
            slot,
            pidfd: Some(pidfd),
            pid,
            torn_down: false,
            landlock: facts.landlock,
            audit: None,
            tun: None,
            kept_writable: None,
            keeps_writable: facts.keeps_writable,
            allow_ptrace: facts.allow_ptrace,
            notifies: facts.notifies,
            connect_ports: facts.connect_ports,
            default_user: facts.default_user,
            keep: true,
        };
        sb.tun = tun;
        Ok(Adopted { tun: sb.take_tun(), sandbox: sb })
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
    /// locks are freed for the next owner, which adopts it. Any other is destroyed, as a drop
    /// would.
    pub fn leave_running(mut self) {
        if self.keep && !self.torn_down {
            self.torn_down = true;
        }
    }
}
