//! Audit of network-policy drops: the per-sandbox `<if>_deny` nft chain logs each refused
//! packet (rate-limited) to an NFLOG group instead of the kernel log, and one thread per
//! node reads that group over `NETLINK_NETFILTER` (kernel `nfnetlink_log`, message format
//! in `include/uapi/linux/netfilter/nfnetlink_log.h`; decoded with the
//! `netlink-packet-netfilter` crate) and keeps, per host-side interface, the packets'
//! protocol and destination until the exec that was running claims them as `violation`
//! events (`layer: "network"`).
//!
//! Only one socket can bind an NFLOG group; the group is derived from the node's nft table
//! name ([`nflog_group`]). When the bind fails (another process holds the group, or the
//! kernel lacks `nfnetlink_log`) drops are still refused and counted by the nft counter,
//! just not reported one by one.
use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
use netlink_packet_netfilter::nflog::{
    config_request, ConfigCmd, ConfigMode, PacketNla, ULogMessage,
};
use netlink_packet_netfilter::{NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily};
use netlink_sys::{constants::NETLINK_NETFILTER, Socket};
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, Mutex, Weak};

/// Most drops kept per interface until an exec takes them (older ones are dropped first).
pub const MAX_DROPS: usize = 256;

/// Bytes of each packet the kernel copies to us: enough for an IPv6 header and the ports.
const SNAPLEN: u32 = 64;

/// One packet the policy refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drop {
    /// `tcp`, `udp`, `icmp`, `icmpv6` or the IP protocol number.
    pub protocol: String,
    /// Destination `ip:port` (TCP, UDP) or `ip`.
    pub dst: String,
    /// When the node read it, Unix milliseconds.
    pub time_unix_ms: u64,
}

/// Drops by host-side interface name, shared with the reader thread.
pub type Drops = Arc<Mutex<HashMap<String, VecDeque<Drop>>>>;

/// NFLOG group of the node whose nft table is `table`: 0x5A00 + (FNV-1a of the name mod
/// 0x600), so two nodes on one host (which need different tables) almost never collide.
pub fn nflog_group(table: &str) -> u16 {
    let mut h: u32 = 0x811c_9dc5;
    for b in table.bytes() {
        h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
    }
    0x5A00 + (h % 0x600) as u16
}

/// The log prefix of interface `h`'s deny chain (NFLOG keeps at most 63 bytes).
pub fn prefix(h: &str) -> String {
    format!("sandlot-deny {h} ")
}

/// Binds NFLOG `group` and starts the reader thread, which records drops whose prefix names
/// an interface present in `drops` and ends once `drops` is gone.
///
/// # Errors
/// The socket, bind or config error (e.g. `EBUSY`: another process reads the group).
pub fn start(group: u16, drops: &Drops) -> std::io::Result<()> {
    let mut sock = Socket::new(NETLINK_NETFILTER)?;
    sock.bind_auto()?;
    // PfBind is a no-op on kernels since 3.17 and an error on none we support: ignore it.
    // Each packet is sent as it is logged: the rule's `queue-threshold 1` (net.rs).
    let binds = [
        (
            NetfilterProtoFamily::IPv4,
            0,
            ConfigCmd::PfBind.into(),
            false,
        ),
        (
            NetfilterProtoFamily::Unspec,
            group,
            ConfigCmd::Bind.into(),
            true,
        ),
    ];
    for (family, res, cmd, must) in binds {
        let req = config_request(
            family,
            res,
            vec![cmd, ConfigMode::new_packet(SNAPLEN).into()],
        );
        let mut buf = vec![0; req.header.length as usize];
        req.serialize(&mut buf);
        sock.send(&buf, 0)?;
        let mut rbuf = vec![0u8; 4096];
        let n = sock.recv(&mut &mut rbuf[..], 0)?;
        if let Ok(NetlinkPayload::Error(e)) =
            NetlinkMessage::<NetfilterMessage>::deserialize(&rbuf[..n]).map(|m| m.payload)
        {
            if let (Some(code), true) = (e.code, must) {
                return Err(std::io::Error::from_raw_os_error(-code.get()));
            }
        }
    }
    let tv = libc::timeval {
        tv_sec: 1,
        tv_usec: 0,
    };
    // SAFETY: setsockopt with a valid timeval of the right size on our own socket.
    let rc = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&sock),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let weak = Arc::downgrade(drops);
    std::thread::Builder::new()
        .name("nflog".into())
        .spawn(move || read_loop(sock, weak))?;
    Ok(())
}

fn read_loop(sock: Socket, drops: Weak<Mutex<HashMap<String, VecDeque<Drop>>>>) {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match sock.recv(&mut &mut buf[..], 0) {
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if drops.strong_count() == 0 {
                    return;
                }
                continue;
            }
            // EINTR: a signal reached this thread (the node's children exit all the time).
            // ENOBUFS: the kernel dropped messages because we were slow. Keep reading.
            Err(e)
                if e.kind() == std::io::ErrorKind::Interrupted
                    || e.raw_os_error() == Some(libc::ENOBUFS) =>
            {
                continue
            }
            Err(e) => {
                tracing::warn!(error = %e, "NFLOG reader stopped: network drops are no longer reported");
                return;
            }
        };
        let Some(drops) = drops.upgrade() else {
            return;
        };
        let now = crate::backends::gvisor_audit::now_ms();
        let mut off = 0;
        while off < n {
            let Ok(m) = NetlinkMessage::<NetfilterMessage>::deserialize(&buf[off..n]) else {
                break;
            };
            let len = m.header.length as usize;
            if let Some((h, d)) = parse(&m, now) {
                let mut map = drops.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(q) = map.get_mut(&h) {
                    if q.len() == MAX_DROPS {
                        q.pop_front();
                    }
                    q.push_back(d);
                }
            }
            if len == 0 {
                break;
            }
            off += (len + 3) & !3;
        }
    }
}

/// The interface named by the prefix and the packet's protocol and destination.
fn parse(m: &NetlinkMessage<NetfilterMessage>, now: u64) -> Option<(String, Drop)> {
    let NetlinkPayload::InnerMessage(NetfilterMessage {
        inner: NetfilterMessageInner::ULog(ULogMessage::Packet(nlas)),
        ..
    }) = &m.payload
    else {
        return None;
    };
    let mut iface = None;
    let mut payload: &[u8] = &[];
    for nla in nlas {
        match nla {
            PacketNla::Prefix(p) => {
                iface = p
                    .to_str()
                    .ok()
                    .and_then(|s| s.strip_prefix("sandlot-deny "))
                    .map(|s| s.trim().to_string());
            }
            PacketNla::Payload(p) => payload = p,
            _ => {}
        }
    }
    let (protocol, dst) = packet_dst(payload)?;
    Some((
        iface?,
        Drop {
            protocol,
            dst,
            time_unix_ms: now,
        },
    ))
}

/// Protocol name and `dst[:port]` of an IPv4 or IPv6 packet (RFC 791, RFC 8200; ports at
/// bytes 2..4 of the TCP/UDP header). A fragment other than the first carries no L4
/// header, so it has no port (IPv4 fragment offset, bytes 6..8; IPv6 Fragment header,
/// next header 44, RFC 8200 §4.5). `None` for anything shorter than an IP header or an
/// IPv4 header length below 5 words.
pub fn packet_dst(p: &[u8]) -> Option<(String, String)> {
    let (proto, ip, l4): (u8, IpAddr, &[u8]) = match p.first()? >> 4 {
        4 if p.len() >= 20 => {
            let ihl = usize::from(p[0] & 0x0f) * 4;
            if ihl < 20 {
                return None;
            }
            let ip = Ipv4Addr::new(p[16], p[17], p[18], p[19]);
            let later_fragment = u16::from_be_bytes([p[6], p[7]]) & 0x1fff != 0;
            let l4 = if later_fragment {
                &[][..]
            } else {
                p.get(ihl..).unwrap_or(&[])
            };
            (p[9], ip.into(), l4)
        }
        6 if p.len() >= 40 => {
            let a: [u8; 16] = p[24..40].try_into().ok()?;
            match (p[6], p.get(40..48)) {
                (44, Some(f)) => {
                    let later_fragment = u16::from_be_bytes([f[2], f[3]]) >> 3 != 0;
                    let l4 = if later_fragment { &[][..] } else { &p[48..] };
                    (f[0], Ipv6Addr::from(a).into(), l4)
                }
                (next, _) => (next, Ipv6Addr::from(a).into(), &p[40..]),
            }
        }
        _ => return None,
    };
    let name = match proto {
        1 => "icmp".to_string(),
        6 => "tcp".into(),
        17 => "udp".into(),
        58 => "icmpv6".into(),
        n => n.to_string(),
    };
    let dst = match (proto, l4.get(2..4)) {
        (6 | 17, Some(port)) => {
            let port = u16::from_be_bytes([port[0], port[1]]);
            match ip {
                IpAddr::V4(a) => format!("{a}:{port}"),
                IpAddr::V6(a) => format!("[{a}]:{port}"),
            }
        }
        _ => ip.to_string(),
    };
    Some((name, dst))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_protocol_and_destination_of_v4_and_v6_packets() {
        let mut v4 = vec![0u8; 24];
        v4[0] = 0x45;
        v4[9] = 6;
        v4[16..20].copy_from_slice(&[169, 254, 169, 254]);
        v4[22..24].copy_from_slice(&80u16.to_be_bytes());
        assert_eq!(
            packet_dst(&v4),
            Some(("tcp".into(), "169.254.169.254:80".into()))
        );
        v4[9] = 1;
        assert_eq!(
            packet_dst(&v4),
            Some(("icmp".into(), "169.254.169.254".into()))
        );
        let mut v6 = vec![0u8; 44];
        v6[0] = 0x60;
        v6[6] = 17;
        v6[39] = 1;
        v6[42..44].copy_from_slice(&53u16.to_be_bytes());
        assert_eq!(packet_dst(&v6), Some(("udp".into(), "[::1]:53".into())));
        assert_eq!(packet_dst(&[0x45, 0, 0]), None);
        assert_eq!(
            packet_dst(&[0x44; 24]),
            None,
            "header length below 20 bytes"
        );
    }

    #[test]
    fn later_fragments_have_no_port() {
        // IPv4 UDP to 10.0.0.9, fragment offset 185 (x 8 bytes): bytes 22..24 are data.
        let mut v4 = vec![0u8; 28];
        v4[0] = 0x45;
        v4[6..8].copy_from_slice(&185u16.to_be_bytes());
        v4[9] = 17;
        v4[16..20].copy_from_slice(&[10, 0, 0, 9]);
        v4[22..24].copy_from_slice(&0x4142u16.to_be_bytes());
        assert_eq!(packet_dst(&v4), Some(("udp".into(), "10.0.0.9".into())));
        // The first fragment (more-fragments flag, offset 0) has the UDP header.
        v4[6..8].copy_from_slice(&0x2000u16.to_be_bytes());
        assert_eq!(
            packet_dst(&v4),
            Some(("udp".into(), "10.0.0.9:16706".into()))
        );
        // IPv6 with a Fragment header (next header 44) in front of UDP to [::1]:53.
        let mut v6 = vec![0u8; 52];
        v6[0] = 0x60;
        v6[6] = 44;
        v6[39] = 1;
        v6[40] = 17;
        v6[42..44].copy_from_slice(&1u16.to_be_bytes()); // offset 0, M flag
        v6[50..52].copy_from_slice(&53u16.to_be_bytes());
        assert_eq!(packet_dst(&v6), Some(("udp".into(), "[::1]:53".into())));
        v6[42..44].copy_from_slice(&(100u16 << 3).to_be_bytes());
        assert_eq!(packet_dst(&v6), Some(("udp".into(), "::1".into())));
        assert_eq!(packet_dst(&[]), None);
    }

    #[test]
    fn groups_differ_by_table_and_stay_in_range() {
        let a = nflog_group("sandlot");
        let b = nflog_group("sandlot_t2");
        assert_ne!(a, b);
        for g in [a, b, nflog_group("")] {
            assert!((0x5A00..0x6000).contains(&g));
        }
    }
}
