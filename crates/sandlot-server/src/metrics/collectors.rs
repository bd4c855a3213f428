//! Metrics read at scrape from outside the server's own counters: this process and its host
//! ([`HostCollector`]: procfs, `getrusage`), and the image store's pull counters
//! ([`PullCollector`]: [`sandlot_node::images::pull_stats`]).
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use sandlot_node::images::pull_stats::PullStats;
use std::sync::{Arc, Mutex};

/// The process and host figures, read from procfs (proc(5): `/proc/self/statm`,
/// `/proc/self/fd`, `/proc/meminfo`, `/proc/stat`, `/proc/loadavg`) and `getrusage(2)` at
/// each scrape. The `process_*` names are the Prometheus client libraries' standard process
/// metrics. In `sandlot up` the server is the node, so these are the node's; a figure that
/// cannot be read is left out of the answer.
#[derive(Debug, Default)]
pub(super) struct HostCollector;

/// `/proc/stat`'s first line: the host's CPU time by mode, in `USER_HZ` ticks.
const CPU_MODES: [&str; 8] = [
    "user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal",
];

fn proc_file(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// `MemTotal` and `MemAvailable` of `/proc/meminfo`, in bytes.
fn meminfo(text: &str) -> (Option<u64>, Option<u64>) {
    let field = |name: &str| {
        text.lines().find_map(|l| {
            let v = l.strip_prefix(name)?.strip_prefix(':')?;
            let kib: u64 = v.trim().strip_suffix("kB")?.trim().parse().ok()?;
            Some(kib * 1024)
        })
    };
    (field("MemTotal"), field("MemAvailable"))
}

/// The host's CPU seconds by mode (`/proc/stat` `cpu` line, ticks / `ticks_per_s`).
fn cpu_seconds(text: &str, ticks_per_s: f64) -> Vec<(&'static str, f64)> {
    let Some(line) = text.lines().find(|l| l.starts_with("cpu ")) else {
        return Vec::new();
    };
    CPU_MODES
        .iter()
        .zip(line.split_whitespace().skip(1))
        .filter_map(|(m, v)| Some((*m, v.parse::<u64>().ok()? as f64 / ticks_per_s)))
        .collect()
}

impl prometheus_client::collector::Collector for HostCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use nix::sys::resource::{getrusage, UsageWho};
        use nix::unistd::{sysconf, SysconfVar};
        let conf = |v| sysconf(v).ok().flatten().filter(|n| *n > 0);
        if let Ok(u) = getrusage(UsageWho::RUSAGE_SELF) {
            let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
            enc.encode_descriptor(
                "process_cpu_seconds",
                "User and system CPU time of this process, seconds",
                None,
                MetricType::Counter,
            )?
            .encode_counter::<NoLabelSet, _, u64>(
                &(secs(u.user_time()) + secs(u.system_time())),
                None,
            )?;
        }
        let page = conf(SysconfVar::PAGE_SIZE).unwrap_or(4096) as u64;
        let rss = proc_file("/proc/self/statm")
            .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok());
        let fds = std::fs::read_dir("/proc/self/fd")
            .ok()
            .map(|d| d.count() as u64);
        let cpus = conf(SysconfVar::_NPROCESSORS_ONLN).map(|n| n as u64);
        for (name, help, v) in [
            (
                "process_resident_memory_bytes",
                "Resident memory of this process, bytes",
                rss.map(|p| p * page),
            ),
            (
                "process_open_fds",
                "Open file descriptors of this process",
                fds,
            ),
            ("sandlot_host_cpus", "CPUs online on the host", cpus),
        ] {
            if let Some(v) = v {
                enc.encode_descriptor(name, help, None, MetricType::Gauge)?
                    .encode_gauge(&(v as i64))?;
            }
        }
        if let Some(text) = proc_file("/proc/meminfo") {
            let (total, available) = meminfo(&text);
            let mut d = enc.encode_descriptor(
                "sandlot_host_memory_bytes",
                "Memory of the host, bytes: total, or available for new work without swapping",
                None,
                MetricType::Gauge,
            )?;
            for (kind, v) in [("total", total), ("available", available)] {
                if let Some(v) = v {
                    d.encode_family(&[("kind", kind)])?
                        .encode_gauge(&(v as i64))?;
                }
            }
        }
        if let (Some(text), Some(hz)) = (proc_file("/proc/stat"), conf(SysconfVar::CLK_TCK)) {
            let mut d = enc.encode_descriptor(
                "sandlot_host_cpu_seconds",
                "CPU time of the host summed over its CPUs, by mode, seconds",
                None,
                MetricType::Counter,
            )?;
            for (mode, v) in cpu_seconds(&text, hz as f64) {
                d.encode_family(&[("mode", mode)])?
                    .encode_counter::<NoLabelSet, _, u64>(&v, None)?;
            }
        }
        if let Some(load1) = proc_file("/proc/loadavg")
            .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        {
            enc.encode_descriptor(
                "sandlot_host_load1",
                "The host's 1-minute load average",
                None,
                MetricType::Gauge,
            )?
            .encode_gauge(&load1)?;
        }
        Ok(())
    }
}

/// `sandlot_image_pulls_total{mode, outcome}` and `sandlot_image_pull_bytes_total{mode}`
/// from the image store's pull counters, set at scrape (`None`: no image store).
#[derive(Debug, Default)]
pub(super) struct PullCollector(pub(super) Arc<Mutex<Option<PullStats>>>);

impl prometheus_client::collector::Collector for PullCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(s) = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
            return Ok(());
        };
        let mut d = enc.encode_descriptor(
            "sandlot_image_pulls",
            "Image pulls into the image store, by mode (eager: whole image; lazy: its index) and outcome",
            None,
            MetricType::Counter,
        )?;
        for (mode, outcomes) in &s.pulls {
            for (outcome, n) in outcomes {
                d.encode_family(&[("mode", mode.as_str()), ("outcome", outcome.as_str())])?
                    .encode_counter::<NoLabelSet, _, u64>(n, None)?;
            }
        }
        let mut d = enc.encode_descriptor(
            "sandlot_image_pull_bytes",
            "Bytes of blobs image pulls downloaded from registries, by mode",
            None,
            MetricType::Counter,
        )?;
        for (mode, n) in &s.blob_bytes {
            d.encode_family(&[("mode", mode.as_str())])?
                .encode_counter::<NoLabelSet, _, u64>(n, None)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn procfs_texts_are_parsed_into_bytes_and_seconds() {
        let m = "MemTotal:       24576000 kB\nMemFree:  1 kB\nMemAvailable:   12288000 kB\n";
        assert_eq!(
            meminfo(m),
            (Some(24_576_000 * 1024), Some(12_288_000 * 1024))
        );
        assert_eq!(meminfo("MemTotal: x kB\n"), (None, None));
        let stat = "cpu  100 0 50 1000 5 0 2 0 0 0\ncpu0 50 0 25 500 2 0 1 0 0 0\n";
        let s = cpu_seconds(stat, 100.0);
        assert_eq!(s.len(), 8);
        assert_eq!(s[0], ("user", 1.0));
        assert_eq!(s[2], ("system", 0.5));
        assert_eq!(s[3], ("idle", 10.0));
        assert!(cpu_seconds("intr 1\n", 100.0).is_empty());
    }
}
