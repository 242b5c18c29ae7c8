//! Sandbox ids that name their node.
//!
//! A standalone server's ids are `i` and 20 of `[a-z0-9]` (E2B's shape). A cluster node appends
//! its name: `i<20 random><node>`. Anyone can split such an id at character 21, so every node's
//! front door knows a sandbox's owner from the id alone, with no lookup per request. The id
//! stays inside E2B's alphabet (no `-`), so `<port>-<id>.<domain>` hosts still parse.

/// Length of a standalone id: `i` and 20 random characters.
pub const BASE_ID_LEN: usize = 21;

/// Longest node name, so that ids stay well under the 64 characters a Host label allows.
pub const MAX_NODE_NAME: usize = 20;

/// A node name: 1 to 20 of `[a-z0-9]`.
pub fn valid_node_name(name: &str) -> bool {
    (1..=MAX_NODE_NAME).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// The node that owns sandbox `id`, when the id names one.
pub fn node_of(id: &str) -> Option<&str> {
    if !id.starts_with('i') {
        return None;
    }
    id.get(BASE_ID_LEN..).filter(|n| valid_node_name(n))
}

/// Length of an access token a standalone server makes: 64 hex digits.
pub const BASE_TOKEN_LEN: usize = 64;

/// The node that owns the sandbox of access token `token`, when the token names one: old SDKs
/// drop the sandbox headers after a connect and send the token alone, so a cluster node's
/// tokens carry its name after their 64 hex digits, as its ids do after their 21 characters.
pub fn node_of_token(token: &str) -> Option<&str> {
    let (hex, node) = (token.get(..BASE_TOKEN_LEN)?, token.get(BASE_TOKEN_LEN..)?);
    hex.bytes().all(|b| b.is_ascii_hexdigit()).then_some(node).filter(|n| valid_node_name(n))
}

/// A new id (or access token) for a sandbox of `node` (a standalone one when `node` is empty).
pub fn with_node(base: String, node: &str) -> String {
    base + node
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_names_its_node() {
        let id = with_node(format!("i{}", "a".repeat(20)), "nodeb");
        assert_eq!(id.len(), 26);
        assert_eq!(node_of(&id), Some("nodeb"));
        assert_eq!(node_of(&format!("i{}", "a".repeat(20))), None);
        assert_eq!(node_of("iabc"), None);
        assert_eq!(node_of(&format!("x{}n1", "a".repeat(20))), None);
    }

    #[test]
    fn a_token_names_its_node() {
        let t = with_node("ab".repeat(32), "n1");
        assert_eq!(node_of_token(&t), Some("n1"));
        assert_eq!(node_of_token(&"ab".repeat(32)), None);
        assert_eq!(node_of_token(&format!("{}n1", "xz".repeat(32))), None);
        assert_eq!(node_of_token("short"), None);
    }

    #[test]
    fn node_names() {
        for ok in ["a", "node1", "n0", &"z".repeat(20)] {
            assert!(valid_node_name(ok), "{ok}");
        }
        for bad in ["", "Node", "node-1", "node.1", &"z".repeat(21), "nöde"] {
            assert!(!valid_node_name(bad), "{bad}");
        }
    }
}
