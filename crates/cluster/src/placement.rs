//! Where a create goes: power of two choices over free memory.
//!
//! Two nodes are drawn at random among those that can take the sandbox, and the one with more
//! free memory goes first; the rest follow, most free memory first, for the router to try when
//! a node refuses. Drawing two rather than taking the best keeps many routers, each with a
//! view a heartbeat old, from all sending a burst to the same node; and each router subtracts
//! what it placed on a node since that node last published, so its own burst spreads too.

use crate::membership::NodeInfo;

/// What a create asks for.
#[derive(Debug, Clone, Default)]
pub struct Want<'a> {
    pub template: &'a str,
    /// The tier the create names, if any (the default tier runs everywhere).
    pub tier: Option<&'a str>,
    /// Its memory cap, bytes.
    pub memory: u64,
}

/// A node with the memory this router placed on it since its last publication.
#[derive(Debug, Clone)]
pub struct Scored {
    pub node: NodeInfo,
    pub pending: u64,
}

impl Scored {
    fn free(&self) -> u64 {
        self.node.free_memory.saturating_sub(self.pending)
    }
}

/// The nodes to try in order. Nodes draining, full, or without the tier are left out; nodes
/// that hold the template come before those that would have to build or fetch it.
pub fn order(nodes: Vec<Scored>, want: &Want<'_>, random: u64) -> Vec<NodeInfo> {
    let fits = |s: &Scored| !s.node.draining && s.node.sandboxes < s.node.max_sandboxes && want.tier.is_none_or(|t| s.node.tiers.iter().any(|x| x == t));
    let (mut holders, mut others): (Vec<Scored>, Vec<Scored>) =
        nodes.into_iter().filter(fits).partition(|s| s.node.templates.iter().any(|t| t == want.template));
    let mut out = two_choices(&mut holders, random);
    others.sort_by(|a, b| b.free().cmp(&a.free()).then_with(|| a.node.name.cmp(&b.node.name)));
    out.extend(others.into_iter().map(|s| s.node));
    out
}

/// Two drawn at random, the freer first, then the rest by free memory.
fn two_choices(nodes: &mut Vec<Scored>, random: u64) -> Vec<NodeInfo> {
    let n = nodes.len();
    if n == 0 {
        return Vec::new();
    }
    let mut first: Vec<Scored> = Vec::new();
    if n >= 2 {
        let i = (random % n as u64) as usize;
        let j = ((random >> 32) % (n as u64 - 1)) as usize;
        let j = if j >= i { j + 1 } else { j };
        let (hi, lo) = if i > j { (i, j) } else { (j, i) };
        let b = nodes.remove(hi);
        let a = nodes.remove(lo);
        let (a, b) = if b.free() > a.free() { (b, a) } else { (a, b) };
        first.push(a);
        first.push(b);
    }
    nodes.sort_by(|a, b| b.free().cmp(&a.free()).then_with(|| a.node.name.cmp(&b.node.name)));
    first.append(nodes);
    first.into_iter().map(|s| s.node).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, free: u64) -> Scored {
        Scored {
            node: NodeInfo {
                name: name.into(),
                url: format!("http://{name}:3000"),
                free_memory: free,
                cpus: 2,
                sandboxes: 0,
                max_sandboxes: 10,
                tiers: vec!["ns".into()],
                templates: vec!["base".into()],
                pools: vec![],
                seq: 1,
                started_unix_ms: 0,
                draining: false,
            },
            pending: 0,
        }
    }

    fn names(v: &[NodeInfo]) -> Vec<&str> {
        v.iter().map(|n| n.name.as_str()).collect()
    }

    #[test]
    fn the_freer_of_two_goes_first_and_every_fitting_node_is_listed() {
        let want = Want { template: "base", tier: None, memory: 1 };
        for r in 0..50u64 {
            let got = order(vec![node("a", 30), node("b", 20), node("c", 10)], &want, r.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            assert_eq!(got.len(), 3);
            // The first is never the least free: it won against another.
            assert_ne!(got[0].name, "c");
        }
    }

    #[test]
    fn draining_full_and_tierless_nodes_are_left_out() {
        let mut d = node("d", 100);
        d.node.draining = true;
        let mut f = node("f", 100);
        f.node.sandboxes = 10;
        let mut g = node("g", 100);
        g.node.tiers = vec!["gvisor".into()];
        let want = Want { template: "base", tier: Some("ns"), memory: 1 };
        assert_eq!(names(&order(vec![d, f, g.clone(), node("a", 1)], &want, 7)), vec!["a"]);
        let want = Want { template: "base", tier: Some("gvisor"), memory: 1 };
        assert_eq!(names(&order(vec![g, node("a", 1)], &want, 7)), vec!["g"]);
    }

    #[test]
    fn holders_of_the_template_come_first() {
        let mut other = node("x", 1000);
        other.node.templates = vec![];
        let want = Want { template: "base", tier: None, memory: 1 };
        assert_eq!(names(&order(vec![other, node("a", 1)], &want, 3)), vec!["a", "x"]);
    }

    #[test]
    fn what_a_router_placed_counts_against_a_node() {
        let mut a = node("a", 30);
        a.pending = 25;
        let want = Want { template: "base", tier: None, memory: 1 };
        assert_eq!(names(&order(vec![a, node("b", 20)], &want, 0)), vec!["b", "a"]);
    }
}
