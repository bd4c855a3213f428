//! Host facts hidden from `function` and runc sandboxes: the procfs and sysfs entries that
//! are global (not namespaced) and would show the host or other sandboxes, and the
//! per-sandbox stand-ins put over some of them (docs/SECURITY.md, "Masked host facts").
//!
//! * [`VIEW_FILES`]: `/proc/meminfo`, `/proc/cpuinfo`, `/proc/stat`, `/proc/loadavg` are
//!   replaced by files [`render`] writes from the sandbox's limits (the LXCFS idea, but
//!   static: written at create and rewritten when a warm-pool member is handed over, not
//!   computed per read). `free` shows the memory limit as total (and as free: usage is not
//!   tracked in the file); glibc's `sysconf(_SC_NPROCESSORS_ONLN)` (Python's
//!   `os.cpu_count()`) counts the `cpuN` lines of `/proc/stat` when `/sys` is absent (the
//!   `function` backend), so it shows the sandbox's cores.
//! * [`MASKED_PROC_FILES`]: read as empty (`/dev/null` bound over them): the host kernel
//!   command line, block devices (`diskstats`, `partitions`: loop devices count and size
//!   other sandboxes' disks), swap files, host-wide memory, interrupt and scheduler
//!   counters, loaded modules, kernel symbols, and runc's default list.
//! * [`MASKED_PROC_DIRS`], [`MASKED_SYS_DIRS`]: an empty read-only tmpfs over them:
//!   `/proc/pressure` (host-wide PSI), and in sysfs every block-device index
//!   (`/sys/block/loop*/loop/backing_file` names other sandboxes' disk images), the
//!   kernel's own tree (`/sys/kernel`) and firmware tables.
//!
//! Not hidden: `/proc/uptime` and the `btime` line of `/proc/stat` (the host's boot time:
//! every process's start time in `/proc/PID/stat` counts from it, and `ps` needs the two
//! to agree; hiding it needs a time namespace), `/proc/version` (what `uname` tells
//! anyway), CPU model and flags (what the `cpuid` instruction tells anyway).

/// A `/proc` file replaced by a per-sandbox stand-in from [`render`].
pub const VIEW_FILES: [&str; 4] = ["meminfo", "cpuinfo", "stat", "loadavg"];

/// `/proc` files that read as empty inside a sandbox.
pub const MASKED_PROC_FILES: &[&str] = &[
    "cmdline",
    "diskstats",
    "partitions",
    "swaps",
    "vmstat",
    "zoneinfo",
    "buddyinfo",
    "pagetypeinfo",
    "slabinfo",
    "modules",
    "kallsyms",
    "interrupts",
    "softirqs",
    "schedstat",
    "mtrr",
    "kcore",
    "keys",
    "timer_list",
    "timer_stats",
    "latency_stats",
    "sched_debug",
];

/// `/proc` directories that show as empty inside a sandbox.
pub const MASKED_PROC_DIRS: &[&str] = &["pressure", "acpi", "asound", "scsi", "driver"];

/// `/sys` directories that show as empty inside a runc sandbox (the `function` backend
/// mounts no sysfs at all).
pub const MASKED_SYS_DIRS: &[&str] = &[
    "block",
    "class/block",
    "dev/block",
    "devices/virtual/block",
    "class/bdi",
    "devices/virtual/bdi",
    "fs/ext4",
    "kernel",
    "firmware",
    "module",
];

/// What a sandbox's stand-ins show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ViewLimits {
    /// The memory limit, MiB (MemTotal, MemFree and MemAvailable of `/proc/meminfo`).
    pub memory_mib: u64,
    /// Cores (the number of processors of `/proc/cpuinfo` and `cpuN` lines of `/proc/stat`),
    /// at least 1.
    pub cpus: u32,
}

impl ViewLimits {
    /// The view of a sandbox with `memory_mib` MiB and a CPU quota of `cpu` cores: the
    /// quota rounded up, at least 1, at most `host_cpus` (when known, i.e. > 0).
    pub fn new(memory_mib: u64, cpu: f64, host_cpus: u32) -> ViewLimits {
        let mut cpus = if cpu.is_finite() && cpu > 0.0 {
            cpu.ceil().min(f64::from(u32::MAX)) as u32
        } else {
            1
        };
        if host_cpus > 0 {
            cpus = cpus.min(host_cpus);
        }
        ViewLimits {
            memory_mib,
            cpus: cpus.max(1),
        }
    }
}

/// The stand-ins of [`VIEW_FILES`] for `limits`, as `(name, content)`, from the host's own
/// `/proc/cpuinfo` text (`host_cpuinfo`: its first `cpus` processor blocks are kept, so the
/// CPU model and flags stay true) and `btime` (the host's boot time, seconds since the
/// epoch: the `btime` line of `/proc/stat`).
pub fn render(limits: ViewLimits, host_cpuinfo: &str, btime: u64) -> Vec<(&'static str, String)> {
    let kib = limits.memory_mib.saturating_mul(1024);
    let mut meminfo = String::new();
    for (k, v) in [
        ("MemTotal", kib),
        ("MemFree", kib),
        ("MemAvailable", kib),
        ("Buffers", 0),
        ("Cached", 0),
        ("SwapCached", 0),
        ("Active", 0),
        ("Inactive", 0),
        ("Shmem", 0),
        ("Slab", 0),
        ("SReclaimable", 0),
        ("SUnreclaim", 0),
        ("SwapTotal", 0),
        ("SwapFree", 0),
        ("Dirty", 0),
        ("Writeback", 0),
        ("AnonPages", 0),
        ("Mapped", 0),
        ("CommitLimit", kib),
        ("Committed_AS", 0),
    ] {
        meminfo.push_str(&format!("{:<16}{v:>8} kB\n", format!("{k}:")));
    }

    let mut cpuinfo = String::new();
    for (i, block) in host_cpuinfo
        .split("\n\n")
        .filter(|b| !b.trim().is_empty())
        .take(limits.cpus as usize)
        .enumerate()
    {
        for line in block.trim_matches('\n').lines() {
            let key = line.split(':').next().unwrap_or("").trim();
            match key {
                "processor" | "core id" | "apicid" | "initial apicid" => {
                    cpuinfo.push_str(&format!("{key}\t\t: {i}\n"))
                }
                "siblings" | "cpu cores" => {
                    cpuinfo.push_str(&format!("{key}\t: {}\n", limits.cpus))
                }
                _ => {
                    cpuinfo.push_str(line);
                    cpuinfo.push('\n');
                }
            }
        }
        cpuinfo.push('\n');
    }

    let zeros = " 0 0 0 0 0 0 0 0 0 0";
    let mut stat = format!("cpu {zeros}\n");
    for i in 0..limits.cpus {
        stat.push_str(&format!("cpu{i}{zeros}\n"));
    }
    stat.push_str(&format!(
        "intr 0\nctxt 0\nbtime {btime}\nprocesses 0\nprocs_running 1\nprocs_blocked 0\nsoftirq 0\n"
    ));

    vec![
        ("meminfo", meminfo),
        ("cpuinfo", cpuinfo),
        ("stat", stat),
        ("loadavg", "0.00 0.00 0.00 1/1 1\n".to_string()),
    ]
}

/// The `btime` line of a `/proc/stat` text (seconds since the epoch), 0 when absent.
pub fn btime_of(proc_stat: &str) -> u64 {
    proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// [`render`] with the host's `/proc/cpuinfo` and `/proc/stat` read now.
///
/// # Errors
/// Reading either file.
pub fn render_host(limits: ViewLimits) -> std::io::Result<Vec<(&'static str, String)>> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo")?;
    let stat = std::fs::read_to_string("/proc/stat")?;
    Ok(render(limits, &cpuinfo, btime_of(&stat)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CPUINFO: &str = "processor\t: 0\nmodel name\t: Test CPU\nsiblings\t: 8\n\n\
                           processor\t: 1\nmodel name\t: Test CPU\nsiblings\t: 8\n\n\
                           processor\t: 2\nmodel name\t: Test CPU\nsiblings\t: 8\n\n";

    fn get<'a>(v: &'a [(&str, String)], name: &str) -> &'a str {
        &v.iter().find(|(n, _)| *n == name).unwrap().1
    }

    #[test]
    fn meminfo_shows_the_limit() {
        let v = render(ViewLimits::new(256, 1.0, 4), CPUINFO, 7);
        let m = get(&v, "meminfo");
        assert!(m.contains("MemTotal:         262144 kB\n"), "{m}");
        assert!(m.contains("MemAvailable:     262144 kB\n"), "{m}");
        assert!(m.contains("SwapTotal:             0 kB\n"), "{m}");
    }

    #[test]
    fn cpus_round_up_and_are_capped_by_the_host() {
        assert_eq!(ViewLimits::new(1, 0.5, 4).cpus, 1);
        assert_eq!(ViewLimits::new(1, 1.5, 4).cpus, 2);
        assert_eq!(ViewLimits::new(1, 8.0, 4).cpus, 4);
        assert_eq!(ViewLimits::new(1, f64::NAN, 4).cpus, 1);
        let v = render(ViewLimits::new(64, 2.0, 0), CPUINFO, 1700000000);
        let c = get(&v, "cpuinfo");
        assert_eq!(c.matches("processor").count(), 2, "{c}");
        assert!(c.contains("siblings\t: 2\n") && c.contains("model name\t: Test CPU"));
        let s = get(&v, "stat");
        assert!(s.contains("cpu0 ") && s.contains("cpu1 ") && !s.contains("cpu2"));
        assert!(s.contains("btime 1700000000\n"));
    }

    #[test]
    fn btime_is_read_from_proc_stat() {
        assert_eq!(btime_of("cpu 1 2\nbtime 42\nprocesses 3\n"), 42);
        assert_eq!(btime_of("cpu 1 2\n"), 0);
    }
}
