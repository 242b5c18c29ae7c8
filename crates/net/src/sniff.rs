//! The host name a TCP connection's first bytes name: TLS SNI (tls-parser) or HTTP Host
//! (httparse). Nothing else of the stream is looked at.

use tls_parser::{parse_tls_extensions, parse_tls_plaintext, SNIType, TlsExtension, TlsMessage, TlsMessageHandshake};

/// What the first bytes say, so far.
#[derive(Debug, PartialEq, Eq)]
pub enum Sniffed {
    /// More bytes are needed to tell.
    Incomplete,
    /// TLS or HTTP naming this host (lower case, port and trailing dot removed).
    Name(String),
    /// A protocol that names no host here (or TLS/HTTP without a name, or an address literal).
    Nameless,
}

/// The most we buffer before deciding: a ClientHello fits one 16 KiB record; request headers
/// beyond this are not HTTP this forwarder needs to name.
pub const MAX_PEEK: usize = 16 * 1024 + 5;

pub fn sniff(buf: &[u8]) -> Sniffed {
    if buf.is_empty() {
        return Sniffed::Incomplete;
    }
    if buf[0] == 0x16 {
        return sniff_tls(buf);
    }
    sniff_http(buf)
}

fn sniff_tls(buf: &[u8]) -> Sniffed {
    if buf.len() < 5 {
        return Sniffed::Incomplete;
    }
    let len = u16::from_be_bytes([buf[3], buf[4]]) as usize;
    if buf.len() < 5 + len {
        return if 5 + len > MAX_PEEK { Sniffed::Nameless } else { Sniffed::Incomplete };
    }
    let Ok((_, record)) = parse_tls_plaintext(&buf[..5 + len]) else { return Sniffed::Nameless };
    for msg in &record.msg {
        let TlsMessage::Handshake(TlsMessageHandshake::ClientHello(hello)) = msg else { continue };
        let Some(ext) = hello.ext else { return Sniffed::Nameless };
        let Ok((_, exts)) = parse_tls_extensions(ext) else { return Sniffed::Nameless };
        for e in exts {
            if let TlsExtension::SNI(names) = e {
                for (kind, name) in names {
                    if kind == SNIType::HostName {
                        return std::str::from_utf8(name).ok().and_then(host_name).map_or(Sniffed::Nameless, Sniffed::Name);
                    }
                }
            }
        }
        return Sniffed::Nameless;
    }
    Sniffed::Nameless
}

fn sniff_http(buf: &[u8]) -> Sniffed {
    // Only bother when it starts like a request line.
    let method_ok = buf.iter().take(8).take_while(|b| **b != b' ').all(|b| b.is_ascii_uppercase());
    if !method_ok {
        return Sniffed::Nameless;
    }
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Partial) if buf.len() < MAX_PEEK => Sniffed::Incomplete,
        Ok(httparse::Status::Partial) | Err(_) => Sniffed::Nameless,
        Ok(httparse::Status::Complete(_)) => req
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("host"))
            .and_then(|h| std::str::from_utf8(h.value).ok())
            .and_then(|v| host_name(strip_port(v.trim())))
            .map_or(Sniffed::Nameless, Sniffed::Name),
    }
}

fn strip_port(v: &str) -> &str {
    if v.starts_with('[') {
        return v; // an IPv6 literal: not a name anyway
    }
    match v.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => v,
    }
}

/// A well-formed host name that is not an address literal.
fn host_name(h: &str) -> Option<String> {
    if h.parse::<std::net::IpAddr>().is_ok() || h.starts_with('[') {
        return None;
    }
    cordon_spec::normalize_name(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_host() {
        assert_eq!(sniff(b"GET / HTTP/1.1\r\nHost: Example.ORG:8080\r\n\r\n"), Sniffed::Name("example.org".into()));
        assert_eq!(sniff(b"GET / HTTP/1.1\r\nHost: exa"), Sniffed::Incomplete);
        assert_eq!(sniff(b"GET / HTTP/1.1\r\nHost: 198.51.100.1\r\n\r\n"), Sniffed::Nameless);
        assert_eq!(sniff(b"GET / HTTP/1.0\r\n\r\n"), Sniffed::Nameless);
        assert_eq!(sniff(b"SSH-2.0-OpenSSH_9.6\r\n"), Sniffed::Nameless);
        assert_eq!(sniff(b"\x00\x01binary"), Sniffed::Nameless);
    }

    #[test]
    fn tls_sni() {
        // A minimal TLS 1.2 ClientHello with SNI "files.example.org".
        let name = b"files.example.org";
        let mut sni = vec![0x00, 0x00]; // extension type: server_name
        let list_len = 3 + name.len();
        sni.extend_from_slice(&((list_len + 2) as u16).to_be_bytes());
        sni.extend_from_slice(&(list_len as u16).to_be_bytes());
        sni.push(0);
        sni.extend_from_slice(&(name.len() as u16).to_be_bytes());
        sni.extend_from_slice(name);
        let mut body = vec![0x03, 0x03];
        body.extend_from_slice(&[7u8; 32]); // random
        body.push(0); // session id
        body.extend_from_slice(&[0x00, 0x02, 0x13, 0x01]); // one cipher suite
        body.extend_from_slice(&[0x01, 0x00]); // null compression
        body.extend_from_slice(&(sni.len() as u16).to_be_bytes());
        body.extend_from_slice(&sni);
        let mut hs = vec![0x01, 0x00];
        hs.extend_from_slice(&(body.len() as u16).to_be_bytes());
        hs.extend_from_slice(&body);
        let mut rec = vec![0x16, 0x03, 0x01];
        rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
        rec.extend_from_slice(&hs);
        assert_eq!(sniff(&rec), Sniffed::Name("files.example.org".into()));
        assert_eq!(sniff(&rec[..20]), Sniffed::Incomplete);
    }
}
