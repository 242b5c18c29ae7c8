//! VMs that outlive the process that made them (a server's restart: an upgrade, a crash,
//! `kill -9`). Nothing of a kept VM depends on its owner but the locks it holds and its
//! connection to the VM's link holder ([`crate::holder`]), which serves the agent's link and
//! holds the monitor's and the network link's host ends. The next owner takes the run
//! directory's lock and the uid slot back, opens a pidfd of the VMM (checked to be in the VM's
//! groups, so that a reused pid is never taken for it), connects to the holder and copies the
//! two ends from it.
//!
//! What is lost: the console's last lines (read by the old owner), and a volume's daemons are
//! no longer the owner's children (they end with the VM's groups, as the VMM does).
//!
//! What the ledger's record does not say is in `vm.json` beside it, written before the record
//! says `keep`.

use std::collections::VecDeque;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{holder, io_err, qmp, Accel, LinkControl, Vm, VmError, VmTier};

const FACTS: &str = "vm.json";

/// What an adopter needs that the ledger's record does not hold.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Facts {
    key: String,
    kvm: bool,
    guest_kernel: String,
    vmm_binary: PathBuf,
    /// Its interface's MAC: a VM has a network link exactly when it has one.
    net_mac: Option<[u8; 6]>,
}

impl Facts {
    pub(crate) fn of(vm: &Vm) -> Facts {
        Facts {
            key: vm.key.clone(),
            kvm: vm.accel == Accel::Kvm,
            guest_kernel: vm.guest_kernel.clone(),
            vmm_binary: vm.vmm_binary.clone(),
            net_mac: vm.net_mac,
        }
    }

    pub(crate) fn write(&self, dir: &Path) -> io::Result<()> {
        cordon_host::ledger::write_facts(dir, FACTS, self)
    }

    fn read(dir: &Path) -> io::Result<Facts> {
        cordon_host::ledger::read_facts(dir, FACTS)
    }
}

impl VmTier {
    /// The ids of the VMs kept running by an owner that is gone: what [`VmTier::adopt`] can
    /// take back.
    pub fn kept(&self) -> Vec<String> {
        self.ledger.kept().into_iter().map(|r| r.id).collect()
    }

    /// Takes back VM `id`, kept running by an owner that is gone (see the module's notes), with
    /// the host end of its network link when it has one ([`Vm::take_net_link`]). On an error it
    /// is left as it was, for [`VmTier::reap_kept`].
    pub fn adopt(&self, id: &str) -> Result<Vm, VmError> {
        let (entry, rec) = self.ledger.adopt(id).map_err(io_err(format!("adopt VM {id}")))?;
        let facts = Facts::read(entry.dir()).map_err(io_err(format!("read the facts of VM {id}")))?;
        let slot = match rec.slot {
            Some(i) => Some(self.slots.claim(i).map_err(io_err(format!("take back the uid range of VM {id}")))?),
            None => None,
        };
        let pid = rec.pid.ok_or_else(|| VmError::Boot(format!("VM {id} has no VMM on record")))?;
        let pidfd = cordon_host::sys::pidfd_open(pid).map_err(io_err(format!("pidfd_open the VMM of VM {id}")))?;
        // Opened, then checked: the pidfd names this process for good, and it is the VM's.
        if !rec.cgroup.holds(pid) {
            return Err(VmError::Boot(format!("VM {id}'s VMM (pid {pid}) is gone")));
        }
        let mut control = holder::Control::connect(entry.dir()).map_err(io_err(format!("connect to the link holder of VM {id}")))?;
        let (monitor, net) = control.take_ends(facts.net_mac.is_some())?;
        let mut qmp = qmp::Qmp::adopt(monitor, Duration::from_secs(30)).map_err(io_err(format!("talk to the monitor of VM {id}")))?;
        // Stopped by a save or a disk copy the old owner's end cut short: it runs on, as when
        // that step fails (a guest parked for it then fails its adopter's health check).
        let status = qmp.execute("query-status", serde_json::json!({})).map_err(io_err(format!("ask the VMM of VM {id}")))?;
        if status["running"] != serde_json::json!(true) {
            qmp.execute("cont", serde_json::json!({})).map_err(io_err(format!("let VM {id} run again")))?;
        }
        Ok(Vm {
            id: id.to_string(),
            socket: entry.dir().join("agent.sock"),
            entry,
            cgroup: rec.cgroup,
            slot,
            pid,
            pidfd: Some(pidfd),
            thread: None,
            monitor: None,
            qmp: Some(qmp),
            link: Some(LinkControl::Holder(control)),
            key: facts.key,
            console: Arc::new(Mutex::new(VecDeque::new())),
            accel: if facts.kvm { Accel::Kvm } else { Accel::Tcg },
            guest_kernel: facts.guest_kernel,
            vmm_binary: facts.vmm_binary,
            shares: Default::default(),
            net,
            net_mac: facts.net_mac,
            torn_down: false,
            parked: false,
            oom_seen: Default::default(),
            holder: None,
        })
    }

    /// Whether VM `id` has a run directory (a live VM, or one not reaped yet).
    pub fn exists(&self, id: &str) -> bool {
        self.ledger.has(id)
    }

    /// Kills and removes the VMs kept running by an owner that is gone and not adopted.
    pub fn reap_kept(&self) -> usize {
        self.ledger.reap_kept()
    }
}
