//! Network policy on the node: a veth per sandbox, nftables filtering and a filtering DNS
//! resolver, for sandboxes whose policy is `{"allow": [...]}` (see
//! [`sandlot_api::NetworkPolicy`]). A `"none"` sandbox needs nothing from here: its backend
//! gives it a fresh network namespace with only `lo`.
//!
//! # What a sandbox with an allow policy gets
//! - A veth pair: host side `<prefix><hash>` (≤ 15 characters, [`NetConfig::veth_prefix`] +
//!   hex of SHA-256 of the id, so leftovers are recognisable and sweepable), sandbox side
//!   `eth0` inside the sandbox's network namespace.
//! - Point-to-point addressing from the node pool ([`NetConfig::pool`], default
//!   `10.200.0.0/16`) cut into /30 slots: slot `k` is `pool + 4k`, the host side `+1`, the
//!   sandbox `+2`; the sandbox's default route goes via the host side. The slot is persisted
//!   in the sandbox's state file, so a restarted node re-adopts it.
//! - IPv4 forwarding (`net.ipv4.ip_forward=1`) and masquerade of pool traffic leaving by a
//!   non-sandbox interface.
//! - nftables (one table for the node, `inet <table>`, default `inet sandlot`): per sandbox
//!   the chains `<if>_fwd` (forward path), `<if>_in` (input path, i.e. the host itself) and
//!   `<if>_deny` (rate-limited NFLOG log with prefix `sandlot-deny <if> `, read by
//!   [`crate::net_audit`], and the named counter
//!   `<if>_drop`, then drop), the sets `<if>_net` (allowlisted CIDRs), `<if>_exp` (entries
//!   inside protected ranges, allowed explicitly) and `<if>_dns` (addresses the resolver
//!   answered for allowed names, element timeout = DNS TTL clamped to
//!   [`MIN_DNS_TIMEOUT`]..=[`MAX_DNS_TTL`]). Base chains dispatch by input interface through
//!   the verdict maps `fwd_vmap` / `in_vmap`.
//! - A filtering DNS resolver ([`crate::dns`]) on `<host side>:53` (UDP and TCP): allowed
//!   names are forwarded to [`NetConfig::upstream`], their A answers added to `<if>_dns`
//!   *before* the answer is sent; every other name is answered REFUSED without contacting the
//!   upstream, so lookups cannot carry data out. Point the sandbox's `/etc/resolv.conf` at
//!   [`Attachment::resolver`].
//!
//! # What is blocked
//! Everything from the sandbox that is not to an allowed destination: in the forward path
//! anything not in `<if>_net`/`<if>_dns`, and any packet whose source is not the sandbox's
//! own address (no spoofing past the masquerade); always (even when an allow entry covers it, e.g.
//! `0.0.0.0/0`) the node pool (other sandboxes), 0.0.0.0/8, 127.0.0.0/8, 224.0.0.0/4,
//! 255.255.255.255 and link-local 169.254.0.0/16 (cloud metadata 169.254.169.254) — except
//! an entry that lies inside one of the latter five, which is allowed exactly; DNS answers
//! pointing into protected ranges stay blocked (no DNS rebinding onto the host or metadata).
//! In the input path (packets to any address of the host itself: its loopback services,
//! the Sandlot server port, its LAN address) only DNS to the sandbox's own resolver address
//! is accepted. All IPv6 from the sandbox is dropped (the data path is IPv4 only). New
//! connections *into* a sandbox are dropped. Drops are counted per sandbox
//! ([`NetworkManager::drop_count`]) and reported, rate-limited, as violations
//! ([`NetworkManager::violations`]).
//!
//! # Host tools
//! This module spawns the `ip` (iproute2) and `nft` (nftables ≥ 0.9.3, Debian package
//! `nftables`) command-line tools instead of speaking netlink itself: their behaviour is
//! documented and stable, every change to the ruleset is one atomic `nft -f -` transaction,
//! and the commands can be replayed by hand when debugging. Missing tools make
//! [`NetworkManager::new`] answer [`NodeError::Unavailable`].
//!
//! # Lifecycle (how a backend uses it)
//! 1. Once per node: [`NetworkManager::new`], then [`NetworkManager::sweep`] with the ids
//!    the node re-adopts (before any new sandbox is created).
//! 2. Per sandbox with an allow policy: get a network namespace (the sandbox init's
//!    `/proc/<pid>/ns/net` while it waits before exec'ing the workload, or a persistent file
//!    from [`create_netns`] that the OCI runtime joins through `namespaces[].path`), call
//!    [`NetworkManager::attach`], write `nameserver <resolver>` into the sandbox's
//!    `/etc/resolv.conf`, *then* start the sandbox's own processes.
//!    A VM (`microvm`, `vm`): a namespace from [`create_netns`], [`NetworkManager::attach`],
//!    then [`bridge_tap`] (the guest takes over the sandbox address on its virtio-net
//!    device behind the tap; [`open_tap`] gives QEMU the tap) and the guest sets its own
//!    `/etc/resolv.conf` from its kernel command line.
//! 3. On delete (any state): [`NetworkManager::teardown`]; idempotent.
use crate::dns::{self, Resolver};
use crate::net_audit;
use crate::node::{NodeError, NodeResult};
use ipnet::Ipv4Net;
use sandlot_api::{AllowPolicy, Violation};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

/// Shortest nft set element timeout for a resolved address; a DNS TTL below it (down to 0)
/// is lengthened to it so a client that connects right after resolving is not refused.
pub const MIN_DNS_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest TTL passed to the sandbox; defined by the resolver, which applies it.
pub use crate::dns::MAX_DNS_TTL;

/// Most addresses in one sandbox's resolved-address set; answers past it make the
/// resolver answer SERVFAIL until elements expire.
pub const DNS_SET_SIZE: usize = 65_536;

/// Ranges a sandbox never reaches unless an allow entry lies inside one of them (RFC 6890:
/// "this network", loopback, link-local incl. cloud metadata 169.254.169.254, multicast,
/// limited broadcast). The node pool is added to these and can never be allowed.
pub const PROTECTED_V4: [(Ipv4Addr, u8); 5] = [
    (Ipv4Addr::new(0, 0, 0, 0), 8),
    (Ipv4Addr::new(127, 0, 0, 0), 8),
    (Ipv4Addr::new(169, 254, 0, 0), 16),
    (Ipv4Addr::new(224, 0, 0, 0), 4),
    (Ipv4Addr::new(255, 255, 255, 255), 32),
];

/// Node-wide network settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    /// Address pool cut into /30 point-to-point slots (default `10.200.0.0/16`: 16,384
    /// sandboxes). Must not overlap the host's own networks.
    pub pool: Ipv4Net,
    /// Upstream DNS server the resolvers forward allowed names to (default: the first
    /// `nameserver` of `/etc/resolv.conf`, port 53; see [`default_upstream`]).
    pub upstream: SocketAddr,
    /// nftables table name in family `inet` (default `sandlot`). Two nodes on one host need
    /// different tables, prefixes and pools.
    pub table: String,
    /// Host-side veth name prefix, 1–6 of `[a-z0-9]` (default `slv`); every link with it
    /// that the node does not know is removed by [`NetworkManager::sweep`].
    pub veth_prefix: String,
    /// Directory of the per-sandbox state files `<id>.json` (e.g. `DATA/net`).
    pub state_dir: PathBuf,
}

impl NetConfig {
    /// Defaults with the state files under `state_dir`.
    ///
    /// # Errors
    /// `Unavailable` when `/etc/resolv.conf` names no IPv4 nameserver.
    pub fn new(state_dir: impl Into<PathBuf>) -> NodeResult<Self> {
        Ok(NetConfig {
            pool: Ipv4Net::new(Ipv4Addr::new(10, 200, 0, 0), 16).expect("valid prefix"),
            upstream: default_upstream()?,
            table: "sandlot".into(),
            veth_prefix: "slv".into(),
            state_dir: state_dir.into(),
        })
    }

    fn check(&self) -> NodeResult<()> {
        let p = &self.veth_prefix;
        if p.is_empty()
            || p.len() > 6
            || !p
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        {
            return Err(NodeError::InvalidArgument(format!(
                "veth prefix {p:?} must be 1-6 of [a-z0-9]"
            )));
        }
        let t = &self.table;
        if t.is_empty()
            || t.len() > 32
            || !t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        {
            return Err(NodeError::InvalidArgument(format!(
                "nft table name {t:?} must be 1-32 of [A-Za-z0-9_]"
            )));
        }
        if self.pool.prefix_len() > 30 {
            return Err(NodeError::InvalidArgument(format!(
                "network pool {} is smaller than one /30",
                self.pool
            )));
        }
        Ok(())
    }
}

/// The first IPv4 `nameserver` of `/etc/resolv.conf`, port 53 (resolv.conf(5)).
///
/// # Errors
/// `Unavailable` when the file cannot be read or names no IPv4 server.
pub fn default_upstream() -> NodeResult<SocketAddr> {
    let text = std::fs::read_to_string("/etc/resolv.conf")
        .map_err(|e| NodeError::Unavailable(format!("cannot read /etc/resolv.conf: {e}")))?;
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|rest| rest.trim().parse::<Ipv4Addr>().ok())
        .map(|ip| SocketAddr::from((ip, 53)))
        .next()
        .ok_or_else(|| NodeError::Unavailable("/etc/resolv.conf names no IPv4 nameserver".into()))
}

/// Persisted per-sandbox state (`<state_dir>/<id>.json`), written before any host resource
/// exists so a crash at any point leaves something [`NetworkManager::sweep`] can undo.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    /// Sandbox id.
    pub id: String,
    /// /30 slot index in the pool.
    pub slot: u32,
    /// Host-side interface name.
    pub host_if: String,
    /// Host-side address (gateway and resolver of the sandbox).
    pub host_addr: Ipv4Addr,
    /// Sandbox-side address (`eth0`).
    pub sandbox_addr: Ipv4Addr,
    /// The policy applied.
    pub policy: AllowPolicy,
    /// The network namespace given to [`NetworkManager::attach`].
    pub netns: PathBuf,
}

/// What a backend needs after [`NetworkManager::attach`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    /// DNS server for the sandbox's `/etc/resolv.conf` (`nameserver <resolver>`); also its
    /// default gateway.
    pub resolver: Ipv4Addr,
    /// The sandbox's address on `eth0` (prefix length 30).
    pub sandbox_addr: Ipv4Addr,
    /// Host-side interface name.
    pub host_if: String,
}

impl Attachment {
    /// Contents for the sandbox's `/etc/resolv.conf` (resolv.conf(5)): its resolver only,
    /// no search domains.
    pub fn resolv_conf(&self) -> String {
        format!("nameserver {}\n", self.resolver)
    }
}

struct Live {
    state: NetState,
    resolver: Resolver,
}

#[derive(Default)]
struct Inner {
    /// slot → id, for every sandbox with state (live or being set up).
    slots: BTreeMap<u32, String>,
    live: HashMap<String, Live>,
}

/// Per-node network manager: allocates addresses, sets sandboxes up and tears them down.
/// Cheap to share (`Arc`); all methods take `&self`. Dropping it stops the resolvers but
/// leaves host state in place (as a crash would); the next [`NetworkManager::sweep`]
/// re-adopts or removes it.
pub struct NetworkManager {
    cfg: NetConfig,
    inner: Mutex<Inner>,
    /// One async lock per id with an attach or teardown in progress: a teardown that comes
    /// while the same id is being attached waits for it, then removes everything.
    ops: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Packets the policies refused, by host interface, read from NFLOG
    /// ([`crate::net_audit`]); an interface is present while its sandbox is attached.
    drops: net_audit::Drops,
}

impl std::fmt::Debug for NetworkManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetworkManager")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// True when `ip` and `nft` can be run; `Err` says which is missing.
///
/// # Errors
/// `Unavailable` naming the missing tool and its Debian package.
pub fn tools_available() -> NodeResult<()> {
    for (tool, pkg) in [("ip", "iproute2"), ("nft", "nftables")] {
        let ok = std::process::Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            return Err(NodeError::Unavailable(format!(
                "network policies need `{tool}` (Debian package {pkg})"
            )));
        }
    }
    Ok(())
}

/// Runs `prog args` (stdin `input` if given) and returns stdout.
async fn run(prog: &str, args: &[&str], input: Option<&str>) -> NodeResult<String> {
    let mut cmd = Command::new(prog);
    cmd.args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let what = format!("{prog} {}", args.join(" "));
    let mut child = cmd
        .spawn()
        .map_err(|e| NodeError::io(format!("spawn `{what}`"), e))?;
    if let Some(text) = input {
        let mut stdin = child.stdin.take().expect("piped");
        stdin
            .write_all(text.as_bytes())
            .await
            .map_err(|e| NodeError::io(format!("write stdin of `{what}`"), e))?;
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(|e| NodeError::io(format!("wait for `{what}`"), e))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let script = input.map(|s| format!("\nscript:\n{s}")).unwrap_or_default();
        return Err(NodeError::io(
            format!(
                "`{what}` failed ({}): {}{script}",
                out.status,
                stderr.trim()
            ),
            std::io::Error::other("command failed"),
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

async fn nft(script: &str) -> NodeResult<()> {
    run("nft", &["-f", "-"], Some(script)).await.map(|_| ())
}

/// Object-name suffixes of one sandbox in the nft table.
const CHAIN_SUFFIXES: [&str; 3] = ["_fwd", "_in", "_deny"];
const SET_SUFFIXES: [&str; 3] = ["_net", "_exp", "_dns"];
const COUNTER_SUFFIX: &str = "_drop";

impl NetworkManager {
    /// Checks the tools, enables IPv4 forwarding and creates (or refreshes) the node's base
    /// nft table. Idempotent; per-sandbox objects already in the table are kept.
    ///
    /// # Errors
    /// `Unavailable` when `ip` or `nft` is missing; `InvalidArgument` for a bad config;
    /// `Internal` when the sysctl, the state directory or the nft transaction fails.
    pub async fn new(cfg: NetConfig) -> NodeResult<Self> {
        cfg.check()?;
        tools_available()?;
        std::fs::create_dir_all(&cfg.state_dir)
            .map_err(|e| NodeError::io(format!("create {}", cfg.state_dir.display()), e))?;
        // Forwarding is host-wide (ip-sysctl.txt: ip_forward); sandboxes cannot route
        // without it. Only IPv4: enabling IPv6 forwarding would turn off router
        // advertisement acceptance on the host's own links.
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
            .map_err(|e| NodeError::io("enable /proc/sys/net/ipv4/ip_forward", e))?;
        let group = net_audit::nflog_group(&cfg.table);
        let m = NetworkManager {
            cfg,
            inner: Mutex::new(Inner::default()),
            ops: Mutex::new(HashMap::new()),
            drops: Default::default(),
        };
        if let Err(e) = net_audit::start(group, &m.drops) {
            tracing::warn!(group, error = %e, "cannot read NFLOG: network-policy drops are counted, not reported per packet");
        }
        nft(&m.base_script()).await?;
        Ok(m)
    }

    /// The configuration.
    pub fn config(&self) -> &NetConfig {
        &self.cfg
    }

    fn base_script(&self) -> String {
        let t = &self.cfg.table;
        let p = &self.cfg.veth_prefix;
        let pool = self.cfg.pool;
        let protected: Vec<String> = PROTECTED_V4
            .iter()
            .map(|(a, l)| format!("{a}/{l}"))
            .chain([pool.to_string()])
            .collect();
        format!(
            "add table inet {t}
add map inet {t} fwd_vmap {{ type ifname : verdict; }}
add map inet {t} in_vmap {{ type ifname : verdict; }}
add set inet {t} protected {{ type ipv4_addr; flags interval; auto-merge; }}
flush set inet {t} protected
add element inet {t} protected {{ {protected} }}
add chain inet {t} forward {{ type filter hook forward priority -10; policy accept; }}
add chain inet {t} input {{ type filter hook input priority -10; policy accept; }}
add chain inet {t} postrouting {{ type nat hook postrouting priority 100; policy accept; }}
flush chain inet {t} forward
flush chain inet {t} input
flush chain inet {t} postrouting
add rule inet {t} forward iifname vmap @fwd_vmap
add rule inet {t} forward iifname \"{p}*\" counter drop
add rule inet {t} forward oifname \"{p}*\" ct state established,related accept
add rule inet {t} forward oifname \"{p}*\" counter drop
add rule inet {t} input iifname vmap @in_vmap
add rule inet {t} input iifname \"{p}*\" counter drop
add rule inet {t} postrouting ip saddr {pool} oifname != \"{p}*\" masquerade
",
            protected = protected.join(", ")
        )
    }

    async fn op_lock(&self, id: &str) -> OpGuard<'_> {
        let lock = self
            .ops
            .lock()
            .expect("ops lock")
            .entry(id.to_owned())
            .or_default()
            .clone();
        let guard = lock.clone().lock_owned().await;
        OpGuard {
            mgr: self,
            id: id.to_owned(),
            lock,
            _guard: guard,
        }
    }

    /// Host-side interface name of sandbox `id`: the prefix + hex of SHA-256(id), 15
    /// characters in all (IFNAMSIZ − 1).
    pub fn host_if(&self, id: &str) -> String {
        let hex: String = Sha256::digest(id.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let p = &self.cfg.veth_prefix;
        format!("{p}{}", &hex[..15 - p.len()])
    }

    fn state_path(&self, id: &str) -> PathBuf {
        self.cfg.state_dir.join(format!("{id}.json"))
    }

    fn slot_addrs(&self, slot: u32) -> (Ipv4Addr, Ipv4Addr) {
        let base = u32::from(self.cfg.pool.network()) + slot * 4;
        (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
    }

    fn slot_count(&self) -> u32 {
        1u32 << (30 - self.cfg.pool.prefix_len())
    }

    /// Sets up the network of sandbox `id` inside the network namespace at `netns` (a
    /// `/proc/<pid>/ns/net` path or an nsfs file such as one from [`create_netns`]) as the
    /// module docs describe, and starts its resolver. Call it before the sandbox's own
    /// processes start, so they never see a half-configured network. On error everything
    /// it made is removed again.
    ///
    /// # Errors
    /// `InvalidArgument` for an invalid policy or id; `Conflict` when `id` is already
    /// attached; `ResourceExhausted` when the pool has no free slot; `Internal` (with the
    /// command and its stderr, and any cleanup failure) when `ip`, `nft` or the resolver
    /// bind fails.
    pub async fn attach(
        &self,
        id: &str,
        netns: &Path,
        policy: &AllowPolicy,
    ) -> NodeResult<Attachment> {
        policy.check().map_err(NodeError::InvalidArgument)?;
        check_id(id)?;
        let _op = self.op_lock(id).await;
        let state = {
            let mut inner = self.inner.lock().expect("net lock");
            if inner.slots.values().any(|v| v == id) {
                return Err(NodeError::Conflict(format!(
                    "sandbox {id} already has a network"
                )));
            }
            let slot = (0..self.slot_count())
                .find(|s| !inner.slots.contains_key(s))
                .ok_or_else(|| {
                    NodeError::ResourceExhausted(format!(
                        "network pool {} is full ({} sandboxes)",
                        self.cfg.pool,
                        self.slot_count()
                    ))
                })?;
            inner.slots.insert(slot, id.to_owned());
            let (host_addr, sandbox_addr) = self.slot_addrs(slot);
            NetState {
                id: id.to_owned(),
                slot,
                host_if: self.host_if(id),
                host_addr,
                sandbox_addr,
                policy: policy.clone(),
                netns: netns.to_owned(),
            }
        };
        match self.setup(&state).await {
            Ok(resolver) => {
                let att = Attachment {
                    resolver: state.host_addr,
                    sandbox_addr: state.sandbox_addr,
                    host_if: state.host_if.clone(),
                };
                self.inner
                    .lock()
                    .expect("net lock")
                    .live
                    .insert(id.to_owned(), Live { state, resolver });
                self.track_drops(&att.host_if);
                Ok(att)
            }
            Err(e) => {
                if let Err(cleanup) = self.remove_state_resources(&state).await {
                    tracing::error!(sandbox = id, error = %cleanup, "network cleanup after a failed attach");
                    self.inner
                        .lock()
                        .expect("net lock")
                        .slots
                        .remove(&state.slot);
                    return Err(NodeError::io(
                        format!("{e}; cleanup also failed: {cleanup}"),
                        std::io::Error::other("attach and cleanup failed"),
                    ));
                }
                self.inner
                    .lock()
                    .expect("net lock")
                    .slots
                    .remove(&state.slot);
                Err(e)
            }
        }
    }

    async fn setup(&self, st: &NetState) -> NodeResult<Resolver> {
        write_state(&self.state_path(&st.id), st)?;
        let ns = st.netns.to_str().ok_or_else(|| {
            NodeError::InvalidArgument(format!("netns path {:?} is not UTF-8", st.netns))
        })?;
        let h = st.host_if.as_str();
        run(
            "ip",
            &[
                "link", "add", h, "type", "veth", "peer", "name", "eth0", "netns", ns,
            ],
            None,
        )
        .await?;
        // No IPv6 on either end (the data path is IPv4 only): no link-local addresses, no
        // router or neighbour solicitations that would show up as policy drops.
        disable_ipv6(None, h).await?;
        disable_ipv6(Some(&st.netns), "eth0").await?;
        let host_cidr = format!("{}/30", st.host_addr);
        run("ip", &["addr", "add", &host_cidr, "dev", h], None).await?;
        run("ip", &["link", "set", h, "up"], None).await?;
        let inside = format!(
            "link set lo up\naddr add {}/30 dev eth0\nlink set eth0 up\nroute add default via {}\n",
            st.sandbox_addr, st.host_addr
        );
        run(
            "nsenter",
            &[&format!("--net={ns}"), "ip", "-batch", "-"],
            Some(&inside),
        )
        .await?;
        nft(&self.sandbox_script(st)).await?;
        self.start_resolver(st).await
    }

    async fn start_resolver(&self, st: &NetState) -> NodeResult<Resolver> {
        let set = NftSet {
            table: self.cfg.table.clone(),
            set: format!("{}_dns", st.host_if),
        };
        Resolver::start(
            SocketAddr::from((st.host_addr, 53)),
            self.cfg.upstream,
            Arc::new(st.policy.clone()),
            Arc::new(move |addrs: Vec<(Ipv4Addr, u32)>| {
                let set = set.clone();
                Box::pin(async move { set.add(&addrs).await })
            }),
        )
        .await
        .map_err(|e| NodeError::io(format!("start DNS resolver on {}:53", st.host_addr), e))
    }

    /// The per-sandbox nft objects, (re)created in one transaction; keeps `<if>_dns`.
    fn sandbox_script(&self, st: &NetState) -> String {
        let t = &self.cfg.table;
        let h = &st.host_if;
        let (mut net, mut exp) = (Vec::new(), Vec::new());
        for n in st.policy.networks() {
            let inside_protected = PROTECTED_V4
                .iter()
                .any(|(a, l)| Ipv4Net::new(*a, *l).expect("valid").contains(&n));
            if self.cfg.pool.contains(&n) {
                continue; // other sandboxes are never reachable
            }
            if inside_protected {
                exp.push(n.to_string());
            } else {
                net.push(n.to_string());
            }
        }
        let mut s = self.sandbox_objects_decl(h);
        for c in CHAIN_SUFFIXES {
            s += &format!("flush chain inet {t} {h}{c}\n");
        }
        s += &format!("flush set inet {t} {h}_net\nflush set inet {t} {h}_exp\n");
        if !net.is_empty() {
            s += &format!("add element inet {t} {h}_net {{ {} }}\n", net.join(", "));
        }
        if !exp.is_empty() {
            s += &format!("add element inet {t} {h}_exp {{ {} }}\n", exp.join(", "));
        }
        let (host, sb) = (st.host_addr, st.sandbox_addr);
        let (prefix, group) = (net_audit::prefix(h), net_audit::nflog_group(t));
        s += &format!(
            "add rule inet {t} {h}_deny limit rate 10/second burst 20 packets log prefix \"{prefix}\" group {group} queue-threshold 1
add rule inet {t} {h}_deny counter name {h}_drop drop
add rule inet {t} {h}_fwd ct state established,related accept
add rule inet {t} {h}_fwd ip saddr != {sb} goto {h}_deny
add rule inet {t} {h}_fwd ip daddr @{h}_exp accept
add rule inet {t} {h}_fwd ip daddr @protected goto {h}_deny
add rule inet {t} {h}_fwd ip daddr @{h}_net accept
add rule inet {t} {h}_fwd ip daddr @{h}_dns accept
add rule inet {t} {h}_fwd goto {h}_deny
add rule inet {t} {h}_in ip saddr {sb} ip daddr {host} udp dport 53 accept
add rule inet {t} {h}_in ip saddr {sb} ip daddr {host} tcp dport 53 accept
add rule inet {t} {h}_in ct state established,related accept
add rule inet {t} {h}_in goto {h}_deny
add element inet {t} fwd_vmap {{ \"{h}\" : jump {h}_fwd }}
add element inet {t} in_vmap {{ \"{h}\" : jump {h}_in }}
"
        );
        s
    }

    /// `add` declarations of every per-sandbox object (no-ops when they exist).
    fn sandbox_objects_decl(&self, h: &str) -> String {
        let t = &self.cfg.table;
        let mut s = String::new();
        for c in CHAIN_SUFFIXES {
            s += &format!("add chain inet {t} {h}{c}\n");
        }
        s += &format!(
            "add set inet {t} {h}_net {{ type ipv4_addr; flags interval; auto-merge; }}
add set inet {t} {h}_exp {{ type ipv4_addr; flags interval; auto-merge; }}
add set inet {t} {h}_dns {{ type ipv4_addr; size {DNS_SET_SIZE}; flags timeout; }}
add counter inet {t} {h}{COUNTER_SUFFIX}
"
        );
        s
    }

    /// Removes the nft objects of host interface `h`, whether or not they exist (the
    /// "add, then delete" idiom keeps the transaction from failing on absent objects).
    fn delete_script(&self, h: &str) -> String {
        let t = &self.cfg.table;
        let mut s = self.sandbox_objects_decl(h);
        s += &format!(
            "add element inet {t} fwd_vmap {{ \"{h}\" : jump {h}_fwd }}
add element inet {t} in_vmap {{ \"{h}\" : jump {h}_in }}
delete element inet {t} fwd_vmap {{ \"{h}\" }}
delete element inet {t} in_vmap {{ \"{h}\" }}
"
        );
        for c in CHAIN_SUFFIXES {
            s += &format!("flush chain inet {t} {h}{c}\n");
        }
        for c in CHAIN_SUFFIXES {
            s += &format!("delete chain inet {t} {h}{c}\n");
        }
        for c in SET_SUFFIXES {
            s += &format!("delete set inet {t} {h}{c}\n");
        }
        s += &format!("delete counter inet {t} {h}{COUNTER_SUFFIX}\n");
        s
    }

    /// Removes every host resource named by `st` (nft objects, veth, netns file, state
    /// file); absent ones are fine. Keeps going after a failure and reports the first.
    async fn remove_state_resources(&self, st: &NetState) -> NodeResult<()> {
        let mut first: Option<NodeError> = None;
        if let Err(e) = nft(&self.delete_script(&st.host_if)).await {
            first.get_or_insert(e);
        }
        if let Err(e) = delete_link(&st.host_if).await {
            first.get_or_insert(e);
        }
        if !st.netns.starts_with("/proc") {
            if let Err(e) = remove_netns(&st.netns) {
                first.get_or_insert(e);
            }
        }
        let path = self.state_path(&st.id);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                first.get_or_insert(NodeError::io(format!("remove {}", path.display()), e));
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Removes everything of sandbox `id`: resolver (its sockets are closed when this
    /// returns), nft chains/sets/counter, veth, the netns file when it is not under `/proc`
    /// (one from [`create_netns`]), the state file and the address lease. Idempotent: an
    /// unknown id is not an error (a state file left by a crash is still honoured).
    ///
    /// # Errors
    /// `Internal` when a removal fails (the first failure; the others are still tried).
    pub async fn teardown(&self, id: &str) -> NodeResult<()> {
        check_id(id)?;
        let _op = self.op_lock(id).await;
        let live = self.inner.lock().expect("net lock").live.remove(id);
        self.drops_map().remove(&self.host_if(id));
        let state = match live {
            Some(l) => {
                l.resolver.stop().await;
                Some(l.state)
            }
            None => read_state(&self.state_path(id)).ok(),
        };
        let st = match state {
            Some(s) => s,
            None => {
                // No state: at most a veth/nft leftover under the derived name.
                let h = self.host_if(id);
                nft(&self.delete_script(&h)).await?;
                return delete_link(&h).await;
            }
        };
        let r = self.remove_state_resources(&st).await;
        if r.is_ok() {
            let mut inner = self.inner.lock().expect("net lock");
            if inner.slots.get(&st.slot).is_some_and(|v| v == id) {
                inner.slots.remove(&st.slot);
            }
        }
        r
    }

    /// At node start: re-adopts the sandboxes in `keep` that have a state file and a live
    /// veth (re-applies their nft objects, keeping resolved addresses, and restarts their
    /// resolvers) and removes everything else of this node's: state files of other ids,
    /// veths with the prefix, nft objects of unknown interfaces. Returns the ids adopted.
    ///
    /// # Errors
    /// `Internal` when listing or removing fails.
    pub async fn sweep(&self, keep: &[String]) -> NodeResult<Vec<String>> {
        nft(&self.base_script()).await?;
        let keep: BTreeSet<&str> = keep.iter().map(String::as_str).collect();
        let links = self.prefixed_links().await?;
        let mut adopted = Vec::new();
        let mut kept_ifs = BTreeSet::new();
        let entries = std::fs::read_dir(&self.cfg.state_dir)
            .map_err(|e| NodeError::io(format!("read {}", self.cfg.state_dir.display()), e))?;
        for entry in entries {
            let entry = entry
                .map_err(|e| NodeError::io(format!("read {}", self.cfg.state_dir.display()), e))?;
            let path = entry.path();
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let st = match read_state(&path) {
                Ok(st) => st,
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unreadable network state removed");
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
            };
            let already = self
                .inner
                .lock()
                .expect("net lock")
                .live
                .contains_key(&st.id);
            if already {
                kept_ifs.insert(st.host_if.clone());
                continue;
            }
            if keep.contains(st.id.as_str()) && links.contains(&st.host_if) {
                nft(&self.sandbox_script(&st)).await?;
                let resolver = self.start_resolver(&st).await?;
                kept_ifs.insert(st.host_if.clone());
                let mut inner = self.inner.lock().expect("net lock");
                inner.slots.insert(st.slot, st.id.clone());
                adopted.push(st.id.clone());
                self.track_drops(&st.host_if);
                inner.live.insert(
                    st.id.clone(),
                    Live {
                        state: st,
                        resolver,
                    },
                );
            } else {
                tracing::info!(sandbox = %st.id, "removing the network of a sandbox not re-adopted");
                self.remove_state_resources(&st).await?;
            }
        }
        for l in links.iter().filter(|l| !kept_ifs.contains(*l)) {
            delete_link(l).await?;
        }
        for h in self.nft_interfaces().await? {
            if !kept_ifs.contains(&h) {
                nft(&self.delete_script(&h)).await?;
            }
        }
        Ok(adopted)
    }

    /// Host links whose name starts with the prefix.
    async fn prefixed_links(&self) -> NodeResult<BTreeSet<String>> {
        let out = run("ip", &["-j", "link", "show"], None).await?;
        let v: serde_json::Value = serde_json::from_str(&out)
            .map_err(|e| NodeError::io("parse `ip -j link show`", std::io::Error::other(e)))?;
        Ok(v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| l["ifname"].as_str())
            .filter(|n| n.starts_with(&self.cfg.veth_prefix) && n.len() == 15)
            .map(str::to_owned)
            .collect())
    }

    /// Host interface names that have per-sandbox objects in the table.
    async fn nft_interfaces(&self) -> NodeResult<BTreeSet<String>> {
        let out = run(
            "nft",
            &["-j", "list", "table", "inet", &self.cfg.table],
            None,
        )
        .await?;
        let v: serde_json::Value = serde_json::from_str(&out)
            .map_err(|e| NodeError::io("parse `nft -j list table`", std::io::Error::other(e)))?;
        let mut found = BTreeSet::new();
        for item in v["nftables"].as_array().into_iter().flatten() {
            for kind in ["chain", "set", "counter"] {
                let Some(name) = item[kind]["name"].as_str() else {
                    continue;
                };
                let sfx = CHAIN_SUFFIXES
                    .iter()
                    .chain(SET_SUFFIXES.iter())
                    .chain([COUNTER_SUFFIX].iter())
                    .find(|s| name.ends_with(*s));
                if let Some(s) = sfx {
                    let h = &name[..name.len() - s.len()];
                    if h.len() == 15 && h.starts_with(&self.cfg.veth_prefix) {
                        found.insert(h.to_owned());
                    }
                }
            }
        }
        Ok(found)
    }

    /// Packets from sandbox `id` dropped by its policy so far (its nft counter
    /// `<if>_drop`), for audit events.
    ///
    /// # Errors
    /// `NotFound` when the sandbox has no network here; `Internal` when `nft` fails.
    pub async fn drop_count(&self, id: &str) -> NodeResult<u64> {
        let h = {
            let inner = self.inner.lock().expect("net lock");
            inner
                .live
                .get(id)
                .map(|l| l.state.host_if.clone())
                .ok_or_else(|| NodeError::NotFound(format!("sandbox {id} has no network")))?
        };
        let name = format!("{h}{COUNTER_SUFFIX}");
        let out = run(
            "nft",
            &["-j", "list", "counter", "inet", &self.cfg.table, &name],
            None,
        )
        .await?;
        let v: serde_json::Value = serde_json::from_str(&out)
            .map_err(|e| NodeError::io("parse `nft -j list counter`", std::io::Error::other(e)))?;
        Ok(v["nftables"]
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|i| i["counter"]["packets"].as_u64())
            .unwrap_or(0))
    }

    /// Resolver counters of sandbox `id` (forwarded and refused queries).
    pub fn dns_stats(&self, id: &str) -> Option<dns::Stats> {
        let inner = self.inner.lock().expect("net lock");
        inner.live.get(id).map(|l| l.resolver.stats())
    }

    /// DNS queries of sandbox `id` its resolver refused within `[since_ms, until_ms]` (Unix
    /// ms), oldest first; refusals before `since_ms` (no exec running to claim them) are
    /// dropped. Empty when `id` has no network policy.
    pub fn dns_refusals(&self, id: &str, since_ms: u64, until_ms: u64) -> Vec<dns::Refusal> {
        let inner = self.inner.lock().expect("net lock");
        let Some(l) = inner.live.get(id) else {
            return Vec::new();
        };
        let mut v = l.resolver.take_refusals(until_ms);
        v.retain(|r| r.time_unix_ms >= since_ms);
        v
    }

    /// What the policy of sandbox `id` refused within `[since_ms, until_ms]` (Unix ms), as
    /// audit violations, oldest first: DNS queries its resolver refused (`layer: "dns"`,
    /// `name`, `qtype`) and packets its nft rules dropped (`layer: "network"`, `protocol`,
    /// `dst`; logged at most 10/s, burst 20, like the kernel log before). Each is returned
    /// once; older ones (no exec running to claim them) are discarded. Empty without a
    /// policy.
    pub fn violations(&self, id: &str, since_ms: u64, until_ms: u64) -> Vec<Violation> {
        let mut v: Vec<Violation> = self
            .dns_refusals(id, since_ms, until_ms)
            .into_iter()
            .map(|r| Violation {
                layer: "dns".into(),
                time_unix_ms: r.time_unix_ms,
                name: Some(r.name),
                qtype: Some(r.qtype),
                ..Default::default()
            })
            .collect();
        if let Some(q) = self.drops_map().get_mut(&self.host_if(id)) {
            let n = q.iter().take_while(|d| d.time_unix_ms <= until_ms).count();
            v.extend(
                q.drain(..n)
                    .filter(|d| d.time_unix_ms >= since_ms)
                    .map(|d| Violation {
                        layer: "network".into(),
                        time_unix_ms: d.time_unix_ms,
                        protocol: Some(d.protocol),
                        dst: Some(d.dst),
                        ..Default::default()
                    }),
            );
        }
        v.sort_by_key(|x| x.time_unix_ms);
        v
    }

    fn drops_map(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, std::collections::VecDeque<net_audit::Drop>>>
    {
        self.drops.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn track_drops(&self, h: &str) {
        self.drops_map().entry(h.to_owned()).or_default();
    }

    /// Whether sandbox `id` has (or is getting) a network here, or a state file of one
    /// left by a previous process: when `false`, [`NetworkManager::teardown`] has nothing
    /// to do and a backend may skip it (and its `nft`/`ip` runs).
    pub fn knows(&self, id: &str) -> bool {
        {
            let inner = self.inner.lock().expect("net lock");
            if inner.live.contains_key(id) || inner.slots.values().any(|v| v == id) {
                return true;
            }
        }
        check_id(id).is_ok() && self.state_path(id).exists()
    }

    /// Ids with a live network on this node.
    pub fn attached(&self) -> Vec<String> {
        let inner = self.inner.lock().expect("net lock");
        let mut v: Vec<String> = inner.live.keys().cloned().collect();
        v.sort();
        v
    }
}

/// Holds the per-id lock; drops the map entry when nobody else waits on it.
struct OpGuard<'a> {
    mgr: &'a NetworkManager,
    id: String,
    lock: Arc<tokio::sync::Mutex<()>>,
    _guard: tokio::sync::OwnedMutexGuard<()>,
}

impl Drop for OpGuard<'_> {
    fn drop(&mut self) {
        let mut ops = self.mgr.ops.lock().expect("ops lock");
        // References: the map's, ours and the owned guard's.
        if Arc::strong_count(&self.lock) <= 3 {
            ops.remove(&self.id);
        }
    }
}

/// The nft set a resolver adds answered addresses to.
#[derive(Clone)]
struct NftSet {
    table: String,
    set: String,
}

impl NftSet {
    /// Adds (or refreshes) `(address, ttl)` elements. The "add, delete, add" sequence in one
    /// transaction resets the timeout of an element that already exists (a plain `add` of an
    /// existing element keeps its old timeout).
    async fn add(&self, addrs: &[(Ipv4Addr, u32)]) -> std::io::Result<()> {
        if addrs.is_empty() {
            return Ok(());
        }
        let (t, s) = (&self.table, &self.set);
        let mut by_addr: BTreeMap<Ipv4Addr, u32> = BTreeMap::new();
        for (a, ttl) in addrs {
            let e = by_addr.entry(*a).or_default();
            *e = (*e).max(*ttl);
        }
        let elems: Vec<String> = by_addr
            .iter()
            .map(|(a, ttl)| {
                let secs = u64::from(*ttl).clamp(MIN_DNS_TIMEOUT.as_secs(), MAX_DNS_TTL.as_secs());
                format!("{a} timeout {secs}s")
            })
            .collect();
        let plain: Vec<String> = by_addr.keys().map(|a| a.to_string()).collect();
        let script = format!(
            "add element inet {t} {s} {{ {e} }}\ndelete element inet {t} {s} {{ {p} }}\nadd element inet {t} {s} {{ {e} }}\n",
            e = elems.join(", "),
            p = plain.join(", ")
        );
        nft(&script)
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))
    }
}

fn check_id(id: &str) -> NodeResult<()> {
    if id.is_empty()
        || id.len() > 128
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        || id.starts_with('.')
    {
        return Err(NodeError::InvalidArgument(format!(
            "sandbox id {id:?} is not a valid name for network state"
        )));
    }
    Ok(())
}

fn write_state(path: &Path, st: &NetState) -> NodeResult<()> {
    let tmp = path.with_extension("json.tmp");
    let data = serde_json::to_vec_pretty(st).expect("state serializes");
    std::fs::write(&tmp, data).map_err(|e| NodeError::io(format!("write {}", tmp.display()), e))?;
    std::fs::rename(&tmp, path)
        .map_err(|e| NodeError::io(format!("rename to {}", path.display()), e))
}

fn read_state(path: &Path) -> NodeResult<NetState> {
    let data =
        std::fs::read(path).map_err(|e| NodeError::io(format!("read {}", path.display()), e))?;
    serde_json::from_slice(&data).map_err(|e| {
        NodeError::io(
            format!("parse {}", path.display()),
            std::io::Error::other(e),
        )
    })
}

/// Sets `net.ipv6.conf.<ifname>.disable_ipv6 = 1` in the host namespace or, with `netns`,
/// in that namespace (a thread that joined it opens `/proc/sys/net`, which resolves to the
/// opener's network namespace). A kernel without IPv6 has no such file: fine.
async fn disable_ipv6(netns: Option<&Path>, ifname: &str) -> NodeResult<()> {
    let file = format!("/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6");
    let ns = netns.map(Path::to_owned);
    let f = file.clone();
    let r = tokio::task::spawn_blocking(move || {
        std::thread::spawn(move || -> std::io::Result<()> {
            if let Some(ns) = ns {
                let fd = std::fs::File::open(&ns)?;
                nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(std::io::Error::from)?;
            }
            match std::fs::write(&f, "1") {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                r => r,
            }
        })
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("sysctl thread panicked")))
    })
    .await
    .unwrap_or_else(|e| Err(std::io::Error::other(e)));
    let place = netns.map_or("host".to_owned(), |p| p.display().to_string());
    r.map_err(|e| NodeError::io(format!("write {file} in {place}"), e))
}

/// Hands the sandbox side of an attached network over to a VM: inside the network
/// namespace `netns` (given to [`NetworkManager::attach`] before), `eth0` loses its address
/// and becomes, with a new persistent tap device `tap` owned by host uid (= gid) `uid`, a
/// port of the bridge `br0` (no STP, no forward delay; IPv6 off on both). The guest then
/// owns the sandbox address ([`Attachment::sandbox_addr`], prefix 30, gateway
/// [`Attachment::resolver`]) on its virtio-net device behind `tap`, so its frames leave by
/// the veth exactly as a container's would: the host-side rules, resolver and drop
/// accounting apply unchanged. QEMU, started in `netns` as `uid`, gets `tap` opened by the
/// node ([`open_tap`]).
/// [`NetworkManager::teardown`] removes it all with the namespace.
///
/// # Errors
/// `Internal` with the `ip` command and its stderr, or the sysctl write that failed.
pub async fn bridge_tap(netns: &Path, tap: &str, uid: u32) -> NodeResult<()> {
    let ns = netns
        .to_str()
        .ok_or_else(|| NodeError::InvalidArgument(format!("netns path {netns:?} is not UTF-8")))?;
    // Interfaces made from now on in this namespace start without IPv6.
    disable_ipv6(Some(netns), "default").await?;
    let batch = format!(
        "addr flush dev eth0\n\
         link add br0 type bridge forward_delay 0 stp_state 0\n\
         tuntap add dev {tap} mode tap user {uid} group {uid}\n\
         link set eth0 master br0\n\
         link set {tap} master br0\n\
         link set br0 up\n\
         link set {tap} up\n"
    );
    run(
        "nsenter",
        &[&format!("--net={ns}"), "ip", "-batch", "-"],
        Some(&batch),
    )
    .await?;
    Ok(())
}

/// Opens the tap device `tap` of the network namespace `netns` (made by [`bridge_tap`]):
/// `/dev/net/tun` + TUNSETIFF (`IFF_TAP | IFF_NO_PI`, no virtio-net header) from a thread
/// that joined `netns`, as root (the device node may be root's alone, mode 0600 on some
/// hosts, and QEMU runs as an unprivileged uid). The descriptor is close-on-exec; QEMU gets
/// it as `-netdev tap,fd=N`.
///
/// # Errors
/// The I/O error of the open, setns(2) or ioctl.
pub fn open_tap(netns: &Path, tap: &str) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let ns = std::fs::File::open(netns)?;
    let name = tap.as_bytes().to_vec();
    std::thread::spawn(move || -> std::io::Result<OwnedFd> {
        nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(std::io::Error::from)?;
        let tun = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/net/tun")?;
        // SAFETY: ifreq is plain old data; all-zero is a valid value.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in req.ifr_name.iter_mut().zip(name.iter().take(15)) {
            *d = *s as libc::c_char;
        }
        req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
        // SAFETY: TUNSETIFF reads one ifreq with a NUL-terminated name and flags.
        if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &req) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = std::os::fd::IntoRawFd::into_raw_fd(tun);
        // SAFETY: `fd` was just released by `tun`; we own it alone.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    })
    .join()
    .unwrap_or_else(|_| Err(std::io::Error::other("tap thread panicked")))
}

async fn delete_link(name: &str) -> NodeResult<()> {
    match run("ip", &["link", "del", name], None).await {
        Ok(_) => Ok(()),
        Err(e) if e.to_string().contains("Cannot find device") => Ok(()),
        Err(e) => Err(e),
    }
}

/// Creates a new, empty network namespace kept alive by a bind mount of its nsfs file on
/// `path` (as `ip netns add` does under `/run/netns`, ip-netns(8)); `path`'s parent must
/// exist. Point an OCI runtime at it with `linux.namespaces[{type: "network", path}]`.
/// Its `lo` is down; [`NetworkManager::attach`] brings it up.
///
/// # Errors
/// `Conflict` when `path` exists; `Internal` when unshare(2) or mount(2) fails (the file is
/// removed again).
pub fn create_netns(path: &Path) -> NodeResult<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => {
                NodeError::Conflict(format!("{} already exists", path.display()))
            }
            _ => NodeError::io(format!("create {}", path.display()), e),
        })?;
    let target = path.to_owned();
    // unshare(CLONE_NEWNET) changes the namespace of the calling thread only; a thread of
    // its own keeps the caller's threads (and the tokio workers) in the host namespace.
    let r = std::thread::spawn(move || -> nix::Result<()> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)?;
        nix::mount::mount(
            Some("/proc/thread-self/ns/net"),
            &target,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
    })
    .join()
    .expect("netns thread does not panic");
    if let Err(e) = r {
        let _ = std::fs::remove_file(path);
        return Err(NodeError::io(
            format!("create network namespace at {}", path.display()),
            std::io::Error::from(e),
        ));
    }
    Ok(())
}

/// Unmounts and removes a namespace file made by [`create_netns`]; absent or already
/// unmounted is fine. The namespace itself lives on while processes are in it.
///
/// # Errors
/// `Internal` when umount(2) or unlink fails for another reason.
pub fn remove_netns(path: &Path) -> NodeResult<()> {
    match nix::mount::umount2(path, nix::mount::MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {}
        Err(e) => {
            return Err(NodeError::io(
                format!("unmount {}", path.display()),
                std::io::Error::from(e),
            ))
        }
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(NodeError::io(format!("remove {}", path.display()), e)),
    }
}

/// The node's one [`NetworkManager`], shared by every backend that applies allow policies
/// (container and function): one address pool, one nft table, one state directory, so
/// sandboxes of different backends never get the same slot and one sweep at node start
/// sees them all. Created on first use, so a node that never gets an allow policy changes
/// nothing on the host (no nft table, no `ip_forward`).
#[derive(Debug)]
pub struct NodeNet {
    state_dir: PathBuf,
    cell: tokio::sync::OnceCell<Result<Arc<NetworkManager>, String>>,
}

impl NodeNet {
    /// A node network whose per-sandbox state files live in `state_dir` (`DATA/net`).
    pub fn new(state_dir: impl Into<PathBuf>) -> Arc<Self> {
        Arc::new(NodeNet {
            state_dir: state_dir.into(),
            cell: tokio::sync::OnceCell::new(),
        })
    }

    /// The state directory (`DATA/net`).
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// The manager, created on the first call ([`NetConfig::new`] + [`NetworkManager::new`]);
    /// a failure is remembered and answered again.
    ///
    /// # Errors
    /// `Unavailable` ("network allow policies are unavailable: …") when the host lacks a
    /// tool, a nameserver or the nft/sysctl setup fails.
    pub async fn get(&self) -> NodeResult<Arc<NetworkManager>> {
        let state_dir = self.state_dir.clone();
        let r = self
            .cell
            .get_or_init(|| async move {
                let cfg = NetConfig::new(state_dir).map_err(|e| e.to_string())?;
                NetworkManager::new(cfg)
                    .await
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .await;
        r.clone().map_err(|why| {
            NodeError::Unavailable(format!("network allow policies are unavailable: {why}"))
        })
    }

    /// The manager when it has been created successfully, without creating it.
    pub fn started(&self) -> Option<Arc<NetworkManager>> {
        self.cell.get().and_then(|r| r.as_ref().ok().cloned())
    }

    /// At node start, after every backend re-adopted its sandboxes: [`NetworkManager::sweep`]
    /// with `keep` = the ids of every backend. Does nothing (and touches nothing on the
    /// host) when no previous process left a state file and no manager runs yet.
    ///
    /// # Errors
    /// `Unavailable` when state files exist but the manager cannot start; `Internal` when
    /// the sweep fails.
    pub async fn sweep(&self, keep: &[String]) -> NodeResult<Vec<String>> {
        let any_state = std::fs::read_dir(&self.state_dir).is_ok_and(|mut d| d.next().is_some());
        if !any_state && self.started().is_none() {
            return Ok(Vec::new());
        }
        self.get().await?.sweep(keep).await
    }
}

impl Drop for NetworkManager {
    fn drop(&mut self) {
        if let Ok(inner) = self.inner.get_mut() {
            for l in inner.live.values() {
                l.resolver.abort();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mgr() -> NetworkManager {
        NetworkManager {
            cfg: NetConfig {
                pool: "10.200.0.0/16".parse().unwrap(),
                upstream: "192.0.2.53:53".parse().unwrap(),
                table: "sandlot".into(),
                veth_prefix: "slv".into(),
                state_dir: "/nonexistent".into(),
            },
            inner: Mutex::new(Inner::default()),
            ops: Mutex::new(HashMap::new()),
            drops: Default::default(),
        }
    }

    #[test]
    fn names_and_addresses() {
        let m = mgr();
        let h = m.host_if("sb-0123456789abcdef0123");
        assert_eq!(h.len(), 15);
        assert!(h.starts_with("slv"));
        assert_ne!(h, m.host_if("sb-0123456789abcdef0124"));
        assert_eq!(
            m.slot_addrs(0),
            (Ipv4Addr::new(10, 200, 0, 1), Ipv4Addr::new(10, 200, 0, 2))
        );
        assert_eq!(
            m.slot_addrs(65),
            (Ipv4Addr::new(10, 200, 1, 5), Ipv4Addr::new(10, 200, 1, 6))
        );
        assert_eq!(m.slot_count(), 16384);
    }

    #[test]
    fn policy_entries_are_split_into_allowed_and_explicit_sets() {
        let m = mgr();
        let policy: AllowPolicy = serde_json::from_value(serde_json::json!({
            "allow": ["10.1.2.0/24", "169.254.169.254", "10.200.0.8/30", "0.0.0.0/0", "pypi.example"]
        }))
        .unwrap();
        let st = NetState {
            id: "sb-x".into(),
            slot: 0,
            host_if: m.host_if("sb-x"),
            host_addr: Ipv4Addr::new(10, 200, 0, 1),
            sandbox_addr: Ipv4Addr::new(10, 200, 0, 2),
            policy,
            netns: "/proc/1/ns/net".into(),
        };
        let s = m.sandbox_script(&st);
        let h = &st.host_if;
        assert!(
            s.contains(&format!(
                "add element inet sandlot {h}_net {{ 10.1.2.0/24, 0.0.0.0/0 }}"
            )),
            "{s}"
        );
        assert!(
            s.contains(&format!(
                "add element inet sandlot {h}_exp {{ 169.254.169.254/32 }}"
            )),
            "{s}"
        );
        assert!(!s.contains("10.200.0.8"), "pool entries never allowed: {s}");
        // protected before the allow set, explicit entries before protected
        let exp = s
            .find("@{h}_exp accept".replace("{h}", h).as_str())
            .unwrap();
        let prot = s.find("@protected goto").unwrap();
        let net = s
            .find("@{h}_net accept".replace("{h}", h).as_str())
            .unwrap();
        assert!(exp < prot && prot < net);
    }

    #[test]
    fn prefix_and_table_are_checked() {
        let mut c = mgr().cfg.clone();
        c.veth_prefix = "toolong".into();
        assert!(c.check().is_err());
        c.veth_prefix = "ab".into();
        c.table = "x; flush ruleset".into();
        assert!(c.check().is_err());
    }
}
