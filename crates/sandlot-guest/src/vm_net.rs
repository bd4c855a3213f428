//! The network of a microVM or VM whose sandbox has an allow policy: the node's side puts
//! [`NetArg`] on the guest kernel's command line (`sandlot.net=ADDR/PREFIX,GATEWAY`) and
//! gives the VM one virtio-net device, bridged on the host to the sandbox's veth (the
//! node's `net` module: nftables and the filtering resolver apply there, outside the
//! guest). The guest's pid 1 loads [`NET_MODULES`] only then, and [`configure`] gives
//! `eth0` the address and default route and `lo` its up flag with the classic
//! netdevice(7) / route ioctls (no netlink library, no `ip` binary in the initramfs).
//! Nothing done here is a security boundary: a guest that changes its address is dropped
//! by the host's rules (source check), and one that never configures has no network.
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Kernel command-line key of the guest's network (see [`NetArg`]).
pub const NET_ARG: &str = "sandlot.net=";

/// Kit modules a guest loads only when it has a network ([`NET_ARG`] present): the
/// virtio-net driver and its dependencies (Linux 6.1: `virtio_net` depends on
/// `net_failover`, which depends on `failover`).
pub const NET_MODULES: &[&str] = &["failover.ko", "net_failover.ko", "virtio_net.ko"];

/// The guest's `eth0` configuration, `sandlot.net=ADDR/PREFIX,GATEWAY` on the kernel
/// command line, e.g. `sandlot.net=10.200.0.2/30,10.200.0.1`; the gateway is also the
/// sandbox's DNS resolver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetArg {
    /// The guest's address.
    pub addr: Ipv4Addr,
    /// Its prefix length (0..=32).
    pub prefix: u8,
    /// Default gateway and resolver.
    pub gateway: Ipv4Addr,
}

impl NetArg {
    /// The kernel command-line word (`sandlot.net=…`).
    pub fn to_arg(&self) -> String {
        format!("{NET_ARG}{}/{},{}", self.addr, self.prefix, self.gateway)
    }

    /// The [`NET_ARG`] word of the command line `cmdline`; `None` when absent or malformed.
    pub fn from_cmdline(cmdline: &str) -> Option<NetArg> {
        let v = cmdline
            .split_whitespace()
            .find_map(|w| w.strip_prefix(NET_ARG))?;
        let (cidr, gw) = v.split_once(',')?;
        let (addr, prefix) = cidr.split_once('/')?;
        let prefix: u8 = prefix.parse().ok().filter(|p| *p <= 32)?;
        Some(NetArg {
            addr: addr.parse().ok()?,
            prefix,
            gateway: gw.parse().ok()?,
        })
    }

    /// Contents of the guest's `/etc/resolv.conf` (resolv.conf(5)): the gateway only.
    pub fn resolv_conf(&self) -> String {
        format!("nameserver {}\n", self.gateway)
    }
}

/// The kernel's `struct rtentry` (include/uapi/linux/route.h) on 64-bit Linux; the libc
/// crate defines it for musl only.
#[repr(C)]
struct RtEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_pad4: *mut libc::c_void,
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

fn sockaddr_v4(a: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(a).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr are both 16 bytes of plain data.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn ifreq(name: &str) -> libc::ifreq {
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes().take(15)) {
        *dst = src as libc::c_char;
    }
    req
}

fn ioctl<T>(sock: &OwnedFd, req: libc::c_ulong, arg: &mut T, what: &str) -> Result<(), String> {
    // SAFETY: `arg` is a live, correctly laid out argument of request `req` (callers pass
    // an ifreq or an RtEntry as netdevice(7) / the route ioctls define them).
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), req, arg as *mut T) };
    if r < 0 {
        return Err(format!("{what}: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

fn set_up(sock: &OwnedFd, name: &str) -> Result<(), String> {
    let mut req = ifreq(name);
    ioctl(
        sock,
        libc::SIOCGIFFLAGS,
        &mut req,
        &format!("SIOCGIFFLAGS {name}"),
    )?;
    // SAFETY: SIOCGIFFLAGS succeeded, so ifru_flags is the active union member.
    unsafe { req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    ioctl(
        sock,
        libc::SIOCSIFFLAGS,
        &mut req,
        &format!("SIOCSIFFLAGS {name}"),
    )
}

/// Configures the guest's network from `net`: IPv6 off on `eth0` (the host drops all IPv6
/// of a sandbox; router solicitations would only show up as drops), its address and
/// netmask, `eth0` and `lo` up, the default route via the gateway. Waits up to 10 s for
/// `eth0` to appear (the driver probes when its module loads).
///
/// # Errors
/// A message naming the step that failed (no `eth0`, an ioctl's errno).
pub fn configure(net: &NetArg) -> Result<(), String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !std::path::Path::new("/sys/class/net/eth0").exists() {
        if std::time::Instant::now() > deadline {
            return Err("no eth0 after 10 s (virtio_net not loaded?)".into());
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // Absent when the kernel runs with ipv6.disable=1: nothing to turn off then.
    let _ = std::fs::write("/proc/sys/net/ipv6/conf/eth0/disable_ipv6", "1");
    // SAFETY: plain socket(2) call; the result is checked and owned at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(format!("socket: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor we exclusively own.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    set_up(&sock, "lo")?;
    let mut req = ifreq("eth0");
    req.ifr_ifru.ifru_addr = sockaddr_v4(net.addr);
    ioctl(&sock, libc::SIOCSIFADDR, &mut req, "SIOCSIFADDR eth0")?;
    let mask = if net.prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(net.prefix))
    };
    let mut req = ifreq("eth0");
    req.ifr_ifru.ifru_netmask = sockaddr_v4(Ipv4Addr::from(mask));
    ioctl(&sock, libc::SIOCSIFNETMASK, &mut req, "SIOCSIFNETMASK eth0")?;
    set_up(&sock, "eth0")?;
    let mut rt = RtEntry {
        rt_pad1: 0,
        rt_dst: sockaddr_v4(Ipv4Addr::UNSPECIFIED),
        rt_gateway: sockaddr_v4(net.gateway),
        rt_genmask: sockaddr_v4(Ipv4Addr::UNSPECIFIED),
        rt_flags: libc::RTF_UP | libc::RTF_GATEWAY,
        rt_pad2: 0,
        rt_pad3: 0,
        rt_pad4: std::ptr::null_mut(),
        rt_metric: 0,
        rt_dev: std::ptr::null_mut(),
        rt_mtu: 0,
        rt_window: 0,
        rt_irtt: 0,
    };
    ioctl(&sock, libc::SIOCADDRT, &mut rt, "SIOCADDRT default")
}

/// Writes `/etc/resolv.conf` of the guest's root (a symlink there, e.g. to systemd's stub
/// file, is replaced by the file).
///
/// # Errors
/// A message with the path and the I/O error.
pub fn write_resolv_conf(net: &NetArg) -> Result<(), String> {
    let p = std::path::Path::new("/etc/resolv.conf");
    let _ = std::fs::create_dir_all("/etc");
    if p.symlink_metadata().is_ok_and(|m| !m.is_file()) {
        let _ = std::fs::remove_file(p);
    }
    std::fs::write(p, net.resolv_conf()).map_err(|e| format!("write /etc/resolv.conf: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_arg_round_trips_and_rejects_malformed_words() {
        let n = NetArg {
            addr: Ipv4Addr::new(10, 200, 0, 6),
            prefix: 30,
            gateway: Ipv4Addr::new(10, 200, 0, 5),
        };
        let line = format!("console=ttyS0 {} quiet", n.to_arg());
        assert_eq!(NetArg::from_cmdline(&line), Some(n));
        assert_eq!(n.resolv_conf(), "nameserver 10.200.0.5\n");
        for bad in [
            "quiet",
            "sandlot.net=10.0.0.2/30",
            "sandlot.net=10.0.0.2/33,10.0.0.1",
            "sandlot.net=10.0.0.x/30,10.0.0.1",
            "sandlot.net=10.0.0.2,10.0.0.1",
        ] {
            assert_eq!(NetArg::from_cmdline(bad), None, "{bad}");
        }
    }

    #[test]
    fn rtentry_has_the_kernels_size() {
        // struct rtentry on x86_64 / aarch64: 120 bytes.
        assert_eq!(std::mem::size_of::<RtEntry>(), 120);
    }
}
