//! Network policy of a sandbox: `"none"` or an allowlist of destinations.
//!
//! Wire shapes (`network` of `POST /v1/sandboxes` and of `Sandbox`):
//!
//! ```json
//! "none"
//! {"allow": ["10.1.2.0/24", "203.0.113.7", "pypi.example", "*.example.org"]}
//! ```
//!
//! Grammar of one `allow` entry (checked when the JSON is parsed, so a bad entry is a 400
//! `invalid_argument` before any sandbox exists):
//!
//! | form | example | meaning |
//! |---|---|---|
//! | IPv4 address | `203.0.113.7` | that address (same as `/32`) |
//! | IPv4 CIDR | `10.1.2.0/24` | the network; host bits must be zero (RFC 4632 §3.1) |
//! | DNS name | `pypi.example` | the name itself (not its subdomains); its A records as resolved through the sandbox's filtering resolver |
//! | wildcard | `*.example.org` | every name strictly below `example.org`, any depth (not `example.org` itself); the suffix needs at least two labels |
//!
//! Names follow the preferred syntax of RFC 1035 §2.3.1 as relaxed by RFC 1123 §2.1
//! (labels of 1–63 letters, digits and `-`, not starting or ending with `-`, at most 253
//! characters in all, the last label not all digits, RFC 3696 §2); they are case-insensitive
//! and echoed lowercase without a trailing dot. IPv6 entries are refused for now (the node's
//! data path is IPv4 only). At most [`MAX_ALLOW_ENTRIES`] entries, at least one (use
//! `"none"` for no network). `null` means the default, `"none"`.
use ipnet::{IpNet, Ipv4Net};
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// Most entries in one `allow` list.
pub const MAX_ALLOW_ENTRIES: usize = 256;

/// Longest DNS name in an entry, characters without the trailing dot (RFC 1035 §3.1 gives
/// 255 octets on the wire, i.e. 253 in text).
const MAX_NAME_CHARS: usize = 253;

/// Network policy of a sandbox (`network` on the wire; see the module docs for the grammar).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum NetworkPolicy {
    /// No network at all: a fresh network namespace with only `lo` (`"none"`, the default).
    #[default]
    None,
    /// Egress only to the listed destinations, DNS only for the listed names
    /// (`{"allow": [...]}`).
    Allow(AllowPolicy),
}

impl NetworkPolicy {
    /// Entries of an allow policy; empty for `None`.
    pub fn allow_entries(&self) -> &[AllowEntry] {
        match self {
            NetworkPolicy::None => &[],
            NetworkPolicy::Allow(p) => &p.allow,
        }
    }

    /// Checks the list limits (1..=[`MAX_ALLOW_ENTRIES`] entries). Parsing from JSON already
    /// does this; this is for values built in code.
    ///
    /// # Errors
    /// A message fit for an `invalid_argument` answer.
    pub fn check(&self) -> Result<(), String> {
        match self {
            NetworkPolicy::None => Ok(()),
            NetworkPolicy::Allow(p) => p.check(),
        }
    }
}

/// `{"allow": [...]}`: the destinations a sandbox may reach.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllowPolicy {
    /// Allowed destinations, 1..=[`MAX_ALLOW_ENTRIES`] entries.
    pub allow: Vec<AllowEntry>,
}

impl AllowPolicy {
    /// Checks the list limits.
    ///
    /// # Errors
    /// A message fit for an `invalid_argument` answer.
    pub fn check(&self) -> Result<(), String> {
        if self.allow.is_empty() {
            return Err(
                "network.allow must list at least one entry; use \"none\" for no network".into(),
            );
        }
        if self.allow.len() > MAX_ALLOW_ENTRIES {
            return Err(format!(
                "network.allow has {} entries; at most {MAX_ALLOW_ENTRIES}",
                self.allow.len()
            ));
        }
        Ok(())
    }

    /// True when DNS name `name` (any case, with or without trailing dot) is allowed by a
    /// name or wildcard entry.
    pub fn allows_name(&self, name: &str) -> bool {
        let n = name.trim_end_matches('.').to_ascii_lowercase();
        self.allow.iter().any(|e| e.matches_name(&n))
    }

    /// The CIDR entries (single addresses as `/32`).
    pub fn networks(&self) -> impl Iterator<Item = Ipv4Net> + '_ {
        self.allow.iter().filter_map(|e| match e {
            AllowEntry::Net(n) => Some(*n),
            _ => None,
        })
    }
}

/// One allowlist entry in canonical form.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AllowEntry {
    /// An IPv4 network; a single address is a `/32` (echoed without the prefix).
    Net(Ipv4Net),
    /// Exactly this DNS name (lowercase, no trailing dot).
    Name(String),
    /// Every name strictly below this suffix (`*.example.org` holds `example.org`).
    Wildcard(String),
}

impl AllowEntry {
    /// True when the entry allows DNS name `name`, which must already be lowercase without
    /// a trailing dot (see [`AllowPolicy::allows_name`] for raw input).
    pub fn matches_name(&self, name: &str) -> bool {
        match self {
            AllowEntry::Net(_) => false,
            AllowEntry::Name(n) => n == name,
            AllowEntry::Wildcard(suffix) => name
                .strip_suffix(suffix.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
        }
    }
}

impl fmt::Display for AllowEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllowEntry::Net(n) if n.prefix_len() == 32 => write!(f, "{}", n.addr()),
            AllowEntry::Net(n) => write!(f, "{n}"),
            AllowEntry::Name(n) => f.write_str(n),
            AllowEntry::Wildcard(s) => write!(f, "*.{s}"),
        }
    }
}

/// Checks a DNS name (already lowercase, no trailing dot) against RFC 1123 §2.1 host name
/// syntax; `what` names the entry in the message.
fn check_name(name: &str, what: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME_CHARS {
        return Err(format!(
            "{what}: a DNS name must be 1-{MAX_NAME_CHARS} characters"
        ));
    }
    for label in name.split('.') {
        let ok = !label.is_empty()
            && label.len() <= 63
            && label
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !ok {
            return Err(format!(
                "{what}: DNS label {label:?} must be 1-63 letters, digits or '-', not starting or ending with '-' (RFC 1123 2.1)"
            ));
        }
    }
    if name
        .rsplit('.')
        .next()
        .is_some_and(|tld| tld.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(format!(
            "{what}: not an IPv4 address, and a DNS name's last label cannot be all digits"
        ));
    }
    Ok(())
}

impl FromStr for AllowEntry {
    type Err = String;

    /// Parses one entry (grammar in the module docs).
    fn from_str(raw: &str) -> Result<Self, String> {
        let what = format!("network.allow entry {raw:?}");
        if raw.contains('/') {
            let net: IpNet = raw
                .parse()
                .map_err(|_| format!("{what}: not a CIDR network such as \"10.1.2.0/24\""))?;
            return match net {
                IpNet::V4(n) if n.trunc() == n => Ok(AllowEntry::Net(n)),
                IpNet::V4(n) => Err(format!(
                    "{what}: host bits are set; did you mean \"{}\"?",
                    n.trunc()
                )),
                IpNet::V6(_) => Err(format!("{what}: IPv6 destinations are not supported yet")),
            };
        }
        if let Ok(addr) = raw.parse::<IpAddr>() {
            return match addr {
                IpAddr::V4(a) => Ok(AllowEntry::Net(Ipv4Net::from(a))),
                IpAddr::V6(_) => Err(format!("{what}: IPv6 destinations are not supported yet")),
            };
        }
        // An IPv4 address in a form `Ipv4Addr` refuses (e.g. "010.1.1.1") must not pass as
        // a name either: the all-digits last label rule below catches those.
        let name = raw.strip_suffix('.').unwrap_or(raw).to_ascii_lowercase();
        if let Some(suffix) = name.strip_prefix("*.") {
            check_name(suffix, &what)?;
            if !suffix.contains('.') {
                return Err(format!(
                    "{what}: a wildcard needs a suffix of at least two labels (\"*.example.org\", not \"*.org\")"
                ));
            }
            return Ok(AllowEntry::Wildcard(suffix.to_owned()));
        }
        if name.contains('*') {
            return Err(format!(
                "{what}: '*' is only allowed as the whole first label (\"*.example.org\")"
            ));
        }
        check_name(&name, &what)?;
        Ok(AllowEntry::Name(name))
    }
}

impl Serialize for AllowEntry {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for AllowEntry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(de::Error::custom)
    }
}

impl Serialize for NetworkPolicy {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            NetworkPolicy::None => s.serialize_str("none"),
            NetworkPolicy::Allow(p) => p.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for NetworkPolicy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = NetworkPolicy;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"none\" or {\"allow\": [...]}")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<NetworkPolicy, E> {
                match v {
                    "none" => Ok(NetworkPolicy::None),
                    other => Err(E::custom(format!(
                        "unknown variant `{other}`, expected `none` or {{\"allow\": [...]}}"
                    ))),
                }
            }
            fn visit_unit<E: de::Error>(self) -> Result<NetworkPolicy, E> {
                Ok(NetworkPolicy::None)
            }
            fn visit_none<E: de::Error>(self) -> Result<NetworkPolicy, E> {
                Ok(NetworkPolicy::None)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<NetworkPolicy, A::Error> {
                let p = AllowPolicy::deserialize(de::value::MapAccessDeserializer::new(map))?;
                p.check().map_err(de::Error::custom)?;
                Ok(NetworkPolicy::Allow(p))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: serde_json::Value) -> Result<NetworkPolicy, String> {
        serde_json::from_value(v).map_err(|e| e.to_string())
    }

    #[test]
    fn none_round_trips_unchanged() {
        assert_eq!(
            serde_json::to_string(&NetworkPolicy::None).unwrap(),
            "\"none\""
        );
        assert_eq!(parse(json!("none")).unwrap(), NetworkPolicy::None);
        assert_eq!(parse(json!(null)).unwrap(), NetworkPolicy::None);
        let e = parse(json!("host")).unwrap_err();
        assert!(e.contains("unknown variant `host`"), "{e}");
    }

    #[test]
    fn allow_parses_and_echoes_canonical_form() {
        let p = parse(json!({"allow": [
            "10.1.2.0/24", "203.0.113.7", "203.0.113.8/32", "PyPI.Example.", "*.Example.org"
        ]}))
        .unwrap();
        assert_eq!(
            serde_json::to_value(&p).unwrap(),
            json!({"allow": ["10.1.2.0/24", "203.0.113.7", "203.0.113.8", "pypi.example", "*.example.org"]})
        );
        let NetworkPolicy::Allow(a) = &p else {
            panic!()
        };
        assert!(a.allows_name("pypi.example."));
        assert!(!a.allows_name("x.pypi.example"));
        assert!(a.allows_name("a.example.org"));
        assert!(a.allows_name("b.a.EXAMPLE.org"));
        assert!(!a.allows_name("example.org"));
        assert!(!a.allows_name("evilexample.org"));
        assert_eq!(a.networks().count(), 3);
        assert_eq!(parse(serde_json::to_value(&p).unwrap()).unwrap(), p);
    }

    #[test]
    fn bad_entries_are_refused_with_a_reason() {
        let cases = [
            (json!({"allow": []}), "at least one"),
            (json!({"allow": ["10.1.2.3/24"]}), "did you mean"),
            (json!({"allow": ["10.1.2.0/33"]}), "not a CIDR"),
            (json!({"allow": ["2001:db8::/32"]}), "IPv6"),
            (json!({"allow": ["::1"]}), "IPv6"),
            (json!({"allow": ["*"]}), "'*'"),
            (json!({"allow": ["a.*.org"]}), "'*'"),
            (json!({"allow": ["*.org"]}), "two labels"),
            (json!({"allow": ["bad_name.example"]}), "DNS label"),
            (json!({"allow": ["-a.example"]}), "DNS label"),
            (json!({"allow": ["a..example"]}), "DNS label"),
            (json!({"allow": ["1.2.3"]}), "all digits"),
            (json!({"allow": ["010.1.1.1"]}), "all digits"),
            (json!({"allow": [" a.example"]}), "DNS label"),
            (
                json!({"allow": [format!("{}.example", "a".repeat(64))]}),
                "DNS label",
            ),
            (json!({"allow": ["a.example"], "deny": []}), "unknown field"),
            (json!({"allow": "a.example"}), "invalid type"),
            (json!(["a.example"]), "expected \"none\""),
        ];
        for (v, needle) in cases {
            let e = parse(v.clone()).unwrap_err();
            assert!(e.contains(needle), "{v}: {e}");
        }
        let many: Vec<String> = (0..=MAX_ALLOW_ENTRIES)
            .map(|i| format!("h{i}.example"))
            .collect();
        let e = parse(json!({ "allow": many })).unwrap_err();
        assert!(e.contains("at most 256"), "{e}");
    }
}
