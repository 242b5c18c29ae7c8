//! The sandbox's only resolver: the forwarder answers DNS on the gateway address, for allowed
//! names only (NXDOMAIN otherwise), by asking the host's upstream itself. No query ever leaves
//! the sandbox as a packet.
//!
//! What does leave is the question this resolver asks upstream for an allowed name, and under
//! a wildcard rule the sandbox picks the name: `<data>.allowed-zone` reaches whoever sees that
//! zone's queries (its authoritative servers, the upstream's operator). A wildcard is therefore
//! a channel to its zone, as wide as the names under it. Only the record types programs need to
//! connect are forwarded ([`FORWARDED`]: addresses, aliases and the HTTPS/SVCB service records
//! browsers and curl ask for); a question of any other type (TXT, NULL, MX, ANY, ...) is
//! answered here with an empty NOERROR, recorded in the audit, and never asked upstream, so
//! answers that carry arbitrary bytes back in (TXT, NULL) are not a channel either.
//!
//! The addresses it hands out are remembered (address -> name), so that a connection that
//! names no host (SSH, a database protocol) to an address this resolver gave for an allowed
//! name is recognised as going to that name.

use crate::audit::AuditLog;
use crate::NetError;
use cordon_spec::{NetworkPolicy, Verdict};
use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::{RData, Record, RecordType};
use hickory_resolver::config::{NameServerConfigGroup, ResolverConfig, ResolverOpts};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::TokioResolver;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::Duration;

/// The query types asked upstream for an allowed name; any other is answered here, empty.
pub const FORWARDED: &[RecordType] = &[RecordType::A, RecordType::AAAA, RecordType::CNAME, RecordType::HTTPS, RecordType::SVCB];

/// Addresses remembered for names; beyond this the memory starts over.
const MAX_REMEMBERED: usize = 16 * 1024;

pub struct Dns {
    resolver: TokioResolver,
    names: Mutex<HashMap<IpAddr, String>>,
}

impl Dns {
    /// `upstream`: the resolver to ask; `None` uses the host's /etc/resolv.conf.
    pub fn new(upstream: Option<SocketAddr>) -> Result<Dns, NetError> {
        let mut opts = ResolverOpts::default();
        opts.timeout = Duration::from_secs(3);
        opts.attempts = 2;
        opts.ndots = 0;
        let resolver = match upstream {
            Some(addr) => {
                let group = NameServerConfigGroup::from_ips_clear(&[addr.ip()], addr.port(), true);
                TokioResolver::builder_with_config(ResolverConfig::from_parts(None, vec![], group), TokioConnectionProvider::default())
                    .with_options(opts)
                    .build()
            }
            None => {
                let mut b = TokioResolver::builder_tokio().map_err(|e| NetError::Resolver(e.to_string()))?;
                let o = b.options_mut();
                o.timeout = opts.timeout;
                o.attempts = opts.attempts;
                b.build()
            }
        };
        Ok(Dns { resolver, names: Mutex::new(HashMap::new()) })
    }

    /// The allowed name this resolver last gave `ip` for, if any.
    pub fn name_of(&self, ip: IpAddr) -> Option<String> {
        self.names.lock().expect("dns lock").get(&cordon_spec::canonical(ip)).cloned()
    }

    fn remember(&self, records: &[Record], name: &str) {
        let mut m = self.names.lock().expect("dns lock");
        if m.len() > MAX_REMEMBERED {
            m.clear();
        }
        for r in records {
            match r.data() {
                RData::A(a) => m.insert(IpAddr::V4(a.0), name.to_string()),
                RData::AAAA(a) => m.insert(IpAddr::V6(a.0), name.to_string()),
                _ => None,
            };
        }
    }

    /// Resolves an allowed name for the forwarder's own dial (DNS pinning).
    pub async fn resolve(&self, name: &str) -> Result<Vec<IpAddr>, String> {
        let fqdn = format!("{name}.");
        match self.resolver.lookup_ip(fqdn.as_str()).await {
            Ok(l) => Ok(l.iter().collect()),
            Err(e) => Err(format!("{name} does not resolve: {e}")),
        }
    }

    /// Answers one DNS message from the sandbox; `None` drops it (not a query we can parse).
    pub async fn answer(&self, query: &[u8], policy: &NetworkPolicy, audit: &AuditLog, dst: SocketAddr) -> Option<Vec<u8>> {
        let req = Message::from_vec(query).ok()?;
        if req.message_type() != MessageType::Query {
            return None;
        }
        let mut resp = Message::new();
        resp.set_id(req.id())
            .set_message_type(MessageType::Response)
            .set_op_code(req.op_code())
            .set_recursion_desired(req.recursion_desired())
            .set_recursion_available(true);
        let q = match (req.op_code(), req.queries()) {
            (OpCode::Query, [q]) => q.clone(),
            _ => {
                resp.set_response_code(ResponseCode::NotImp);
                return resp.to_vec().ok();
            }
        };
        resp.add_query(q.clone());
        let name = q.name().to_ascii();
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        let verdict = policy.answers_dns_for(&name);
        if !verdict.allowed() {
            let reason = match verdict {
                Verdict::Deny(r) => format!("name denied by rule {r}"),
                _ => "no rule allows this name".to_string(),
            };
            audit.record("dns", dst.to_string(), Some(name), reason);
            resp.set_response_code(ResponseCode::NXDomain);
            return resp.to_vec().ok();
        }
        // An empty NOERROR ("no records of this type") rather than NOTIMP: it is the answer a
        // stub resolver expects for a type a name lacks, so programs carry on (glibc, Python and
        // curl take it as "none"), where NOTIMP makes some resolvers try the next server or
        // report the resolver broken. It says nothing about what upstream holds.
        if !FORWARDED.contains(&q.query_type()) {
            audit.record("dns", dst.to_string(), Some(name), format!("query type {} is answered here, never forwarded", q.query_type()));
            resp.set_response_code(ResponseCode::NoError);
            return resp.to_vec().ok();
        }
        let fqdn = format!("{name}.");
        match self.resolver.lookup(fqdn.as_str(), q.query_type()).await {
            Ok(lookup) => {
                let records: Vec<Record> = lookup.records().to_vec();
                if matches!(q.query_type(), RecordType::A | RecordType::AAAA) {
                    self.remember(&records, &name);
                }
                resp.add_answers(records);
                resp.set_response_code(ResponseCode::NoError);
            }
            Err(e) if e.is_nx_domain() => {
                resp.set_response_code(ResponseCode::NXDomain);
            }
            Err(e) if e.is_no_records_found() => {
                resp.set_response_code(ResponseCode::NoError);
            }
            Err(e) => {
                tracing::debug!(%name, "upstream DNS failed: {e}");
                resp.set_response_code(ResponseCode::ServFail);
            }
        }
        resp.to_vec().ok()
    }
}
