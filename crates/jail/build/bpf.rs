//! Compiles a syscall policy into one classic-BPF program that finds a syscall's verdict by
//! binary search over syscall numbers.
//!
//! seccompiler emits a linear chain: one comparison per named syscall, about 1,600 instructions
//! for our allowlist. Since Linux 5.11 the kernel, when a filter is attached, emulates it once
//! for every syscall number to learn which ones it always allows, so a linear chain makes
//! attaching cost `syscalls x length` emulated instructions, which the bench measured as several
//! milliseconds per sandbox. A search over ranges of numbers with the same verdict is a few
//! hundred instructions and needs about seven comparisons per number. seccompiler cannot emit it,
//! so this does; it still compiles the same policy as the reference the tests compare against.

use std::collections::BTreeMap;

pub type Insn = (u16, u8, u8, u32);

const LD_W_ABS: u16 = 0x20;
const ALU_AND_K: u16 = 0x54;
const JMP_JA: u16 = 0x05;
const JMP_JEQ_K: u16 = 0x15;
const JMP_JGE_K: u16 = 0x35;
const RET_K: u16 = 0x06;

const SECCOMP_RET_KILL_PROCESS: u32 = 0x8000_0000;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
/// `struct seccomp_data`: `nr` at 0, `arch` at 4, `args[6]` from 16.
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;
const DATA_ARGS: u32 = 16;
const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
/// The kernel's limit on a program's length (BPF_MAXINSNS).
const MAX_INSNS: usize = 4096;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Verdict {
    Allow,
    Errno(u16),
    /// Not allowed by the allowlist: EPERM, or the supervisor's verdict when audited.
    Deny,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Op {
    Eq,
    Ne,
    MaskedEq(u64),
}

/// A comparison of one argument. A dword compares the low 32 bits only, as seccompiler does.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Cond {
    pub index: u8,
    pub qword: bool,
    pub op: Op,
    pub val: u64,
}

/// Holds when all of its conditions hold; an empty rule always holds.
pub type Rule = Vec<Cond>;

/// One syscall's verdict: the first clause with a rule that holds decides, else `otherwise`.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Handler {
    pub clauses: Vec<(Vec<Rule>, Verdict)>,
    pub otherwise: Verdict,
}

impl Handler {
    pub fn fixed(v: Verdict) -> Self {
        Handler { clauses: Vec::new(), otherwise: v }
    }

    /// Drops what can never decide: everything after a clause with an always-true rule, which
    /// becomes `otherwise`. Equal handlers then compare equal, so neighbours merge into ranges.
    fn normalized(mut self) -> Self {
        if let Some(i) = self.clauses.iter().position(|(rules, _)| rules.iter().any(Vec::is_empty)) {
            self.otherwise = self.clauses[i].1;
            self.clauses.truncate(i);
        }
        self.clauses.retain(|(rules, _)| !rules.is_empty());
        self
    }
}

/// A jump target while a rule's code is built: `Next(n)` skips n instructions, `Fail` goes to
/// the next rule.
#[derive(Clone, Copy)]
enum J {
    Next(u8),
    Fail,
}

fn ret(v: Verdict, deny: u32) -> Insn {
    let k = match v {
        Verdict::Allow => SECCOMP_RET_ALLOW,
        Verdict::Errno(e) => SECCOMP_RET_ERRNO | u32::from(e),
        Verdict::Deny => deny,
    };
    (RET_K, 0, 0, k)
}

fn cond_code(c: &Cond, out: &mut Vec<(u16, J, J, u32)>) {
    let lo = DATA_ARGS + 8 * u32::from(c.index);
    let hi = lo + 4;
    let (vh, vl) = ((c.val >> 32) as u32, c.val as u32);
    let ld = |off| (LD_W_ABS, J::Next(0), J::Next(0), off);
    let and = |m| (ALU_AND_K, J::Next(0), J::Next(0), m);
    let eq = |v, t, f| (JMP_JEQ_K, t, f, v);
    match (c.op, c.qword) {
        (Op::Eq, false) => out.extend([ld(lo), eq(vl, J::Next(0), J::Fail)]),
        (Op::Ne, false) => out.extend([ld(lo), eq(vl, J::Fail, J::Next(0))]),
        (Op::MaskedEq(m), false) => out.extend([ld(lo), and(m as u32), eq(vl & m as u32, J::Next(0), J::Fail)]),
        (Op::Eq, true) => out.extend([ld(hi), eq(vh, J::Next(0), J::Fail), ld(lo), eq(vl, J::Next(0), J::Fail)]),
        // Differs when either half differs: a differing high half skips the low half's test.
        (Op::Ne, true) => out.extend([ld(hi), eq(vh, J::Next(0), J::Next(2)), ld(lo), eq(vl, J::Fail, J::Next(0))]),
        (Op::MaskedEq(m), true) => {
            let (mh, ml) = ((m >> 32) as u32, m as u32);
            out.extend([ld(hi), and(mh), eq(vh & mh, J::Next(0), J::Fail)]);
            out.extend([ld(lo), and(ml), eq(vl & ml, J::Next(0), J::Fail)]);
        }
    }
}

/// A rule's conditions followed by its verdict; a failing condition jumps past the verdict.
fn rule_code(rule: &Rule, verdict: Insn) -> Vec<Insn> {
    let mut pending = Vec::new();
    for c in rule {
        cond_code(c, &mut pending);
    }
    let end = pending.len() + 1;
    let mut out: Vec<Insn> = pending
        .iter()
        .enumerate()
        .map(|(i, &(code, jt, jf, k))| {
            let off = |j| match j {
                J::Next(n) => n,
                J::Fail => u8::try_from(end - (i + 1)).expect("a rule too long for an 8-bit jump"),
            };
            (code, off(jt), off(jf), k)
        })
        .collect();
    out.push(verdict);
    out
}

fn handler_code(h: &Handler, deny: u32) -> Vec<Insn> {
    let mut out = Vec::new();
    for (rules, v) in &h.clauses {
        for rule in rules {
            out.extend(rule_code(rule, ret(*v, deny)));
        }
    }
    out.push(ret(h.otherwise, deny));
    out
}

/// Ranges `(first number, handler)`, in order: a search on `nr >= first` picks the range.
fn search(ranges: &[(u32, &Handler)], deny: u32) -> Vec<Insn> {
    if let [(_, h)] = ranges {
        return handler_code(h, deny);
    }
    let mid = ranges.len() / 2;
    let below = search(&ranges[..mid], deny);
    let above = search(&ranges[mid..], deny);
    let mut out = Vec::with_capacity(below.len() + above.len() + 2);
    match u8::try_from(below.len()) {
        Ok(skip) => out.push((JMP_JGE_K, skip, 0, ranges[mid].0)),
        // A conditional jump reaches 255 instructions at most; an unconditional one goes further.
        Err(_) => out.extend([(JMP_JGE_K, 0, 1, ranges[mid].0), (JMP_JA, 0, 0, below.len() as u32)]),
    }
    out.extend(below);
    out.extend(above);
    out
}

/// The program: kill a process that calls in with another architecture's numbers, then search.
/// Numbers `syscalls` does not name, including x32's (bit 30 set), get `Deny`, whose return
/// value is `deny`.
pub fn compile(syscalls: &BTreeMap<u32, Handler>, deny: u32) -> Vec<Insn> {
    let unlisted = Handler::fixed(Verdict::Deny);
    let handlers: BTreeMap<u32, Handler> =
        syscalls.iter().map(|(nr, h)| (*nr, h.clone().normalized())).collect();
    let mut ranges: Vec<(u32, &Handler)> = Vec::new();
    let last = handlers.keys().next_back().copied().unwrap_or(0);
    for nr in 0..=last.saturating_add(1) {
        let h = handlers.get(&nr).unwrap_or(&unlisted);
        if ranges.last().is_none_or(|(_, prev)| *prev != h) {
            ranges.push((nr, h));
        }
    }
    let mut prog = vec![
        (LD_W_ABS, 0, 0, DATA_ARCH),
        (JMP_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        (RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS),
        (LD_W_ABS, 0, 0, DATA_NR),
    ];
    prog.extend(search(&ranges, deny));
    assert!(prog.len() <= MAX_INSNS, "the syscall filter has {} instructions, over the kernel's {MAX_INSNS}", prog.len());
    prog
}
