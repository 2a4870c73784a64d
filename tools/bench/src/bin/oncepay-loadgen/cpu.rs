//! CPU time from /proc/<pid>/stat (utime + stime, and cutime + cstime for reaped children),
//! split three ways so the report shows who spends the machine: the oncepay server(s),
//! PostgreSQL (every process of the bench cluster) and the load generator (this process, or
//! the pgbench it ran).

use anyhow::Context;

/// The numeric fields of /proc/<pid>/stat after the command name: index 0 is field 3 (state),
/// 1 is ppid, 11/12 are utime/stime, 13/14 are cutime/cstime (children already waited for).
fn stat_fields(pid: &str) -> anyhow::Result<Vec<u64>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("no process {pid}"))?;
    // The command name (field 2) may hold spaces; the numeric fields follow its last ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).context("unreadable stat")?;
    Ok(rest
        .split_whitespace()
        .map(|f| f.parse::<i64>().map_or(0, |v| v.max(0) as u64))
        .collect())
}

fn field(fields: &[u64], index: usize) -> anyhow::Result<u64> {
    fields.get(index).copied().context("short /proc stat line")
}

/// utime + stime of one process (all its threads, live and exited).
fn own_ticks(pid: &str) -> anyhow::Result<u64> {
    let f = stat_fields(pid)?;
    Ok(field(&f, 11)? + field(&f, 12)?)
}

/// The machine's (steal, all) ticks so far, from /proc/stat's `cpu` line.
fn host_ticks() -> anyhow::Result<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().context("empty /proc/stat")?;
    // user nice system idle iowait irq softirq steal guest guest_nice; guest time is already
    // counted in user.
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    Ok((ticks.get(7).copied().unwrap_or(0), ticks.iter().sum()))
}

/// Total user + system CPU seconds of `pids` so far.
pub fn seconds(pids: &[u32], clock_ticks_per_sec: u32) -> anyhow::Result<f64> {
    let mut ticks = 0u64;
    for pid in pids {
        ticks += own_ticks(&pid.to_string())?;
    }
    Ok(ticks as f64 / f64::from(clock_ticks_per_sec))
}

/// CPU seconds of a PostgreSQL cluster so far: the postmaster's own and its reaped children's
/// (cutime + cstime: backends that already exited, e.g. pgbench's), plus every live child's
/// (backends, autovacuum, WAL writer, checkpointer). A backend that exits between two readings
/// moves from the live sum to the postmaster's cutime, so the difference stays right.
pub fn cluster_seconds(postmaster: u32, clock_ticks_per_sec: u32) -> anyhow::Result<f64> {
    let pm = stat_fields(&postmaster.to_string())?;
    let mut ticks = field(&pm, 11)? + field(&pm, 12)? + field(&pm, 13)? + field(&pm, 14)?;
    for entry in std::fs::read_dir("/proc")? {
        let name = entry?.file_name();
        let Some(pid) = name.to_str().filter(|n| n.bytes().all(|b| b.is_ascii_digit())) else {
            continue;
        };
        // A process may end between the listing and the read: it is then counted in cutime.
        let Ok(f) = stat_fields(pid) else { continue };
        if f.get(1) == Some(&u64::from(postmaster)) {
            ticks += field(&f, 11)? + field(&f, 12)?;
        }
    }
    Ok(ticks as f64 / f64::from(clock_ticks_per_sec))
}

/// This process's own CPU seconds (the HTTP load generator).
pub fn self_seconds(clock_ticks_per_sec: u32) -> anyhow::Result<f64> {
    Ok(own_ticks("self")? as f64 / f64::from(clock_ticks_per_sec))
}

/// CPU seconds of this process's children that were waited for (pgbench).
pub fn children_seconds(clock_ticks_per_sec: u32) -> anyhow::Result<f64> {
    let f = stat_fields("self")?;
    Ok((field(&f, 13)? + field(&f, 14)?) as f64 / f64::from(clock_ticks_per_sec))
}

/// Whose CPU counts as the load generator's.
#[derive(Clone, Copy)]
pub enum Client {
    /// This process (the HTTP side).
    Me,
    /// The children it waited for (pgbench).
    Children,
}

/// CPU seconds per answered request of one step, three ways.
#[derive(Default)]
pub struct PerRequest {
    pub server: Option<f64>,
    pub postgres: Option<f64>,
    pub client: Option<f64>,
    /// The card processor's (localstripe), where its pid was given.
    pub processor: Option<f64>,
    /// The share of the machine's CPU time stolen by the host during the step.
    pub host_steal: Option<f64>,
}

/// Readings at the start of a step.
pub struct Meter {
    server_pids: Vec<u32>,
    postmaster: Option<u32>,
    ticks: u32,
    client: Client,
    processor_pid: Option<u32>,
    start: Reading,
    host_start: (u64, u64),
}

/// CPU seconds so far: servers, PostgreSQL, load generator, processor.
type Reading = (f64, Option<f64>, f64, Option<f64>);

impl Meter {
    pub fn start(server_pids: &[u32], postmaster: Option<u32>, ticks: u32, client: Client) -> anyhow::Result<Self> {
        Self::start_with_processor(server_pids, postmaster, ticks, client, None)
    }

    /// As [`Meter::start`], also charging the card processor's process (`processor_pid`).
    pub fn start_with_processor(
        server_pids: &[u32],
        postmaster: Option<u32>,
        ticks: u32,
        client: Client,
        processor_pid: Option<u32>,
    ) -> anyhow::Result<Self> {
        let mut meter = Self {
            server_pids: server_pids.to_vec(),
            postmaster,
            ticks,
            client,
            processor_pid,
            start: (0.0, None, 0.0, None),
            host_start: host_ticks()?,
        };
        meter.start = meter.read()?;
        Ok(meter)
    }

    fn read(&self) -> anyhow::Result<Reading> {
        let server = seconds(&self.server_pids, self.ticks)?;
        let postgres = self.postmaster.map(|pm| cluster_seconds(pm, self.ticks)).transpose()?;
        let client = match self.client {
            Client::Me => self_seconds(self.ticks)?,
            Client::Children => children_seconds(self.ticks)?,
        };
        let processor = self.processor_pid.map(|p| seconds(&[p], self.ticks)).transpose()?;
        Ok((server, postgres, client, processor))
    }

    /// The step's CPU per request: `None` where nothing was measured or nothing answered.
    pub fn stop(&self, requests: u64) -> anyhow::Result<PerRequest> {
        let (server, postgres, client, processor) = self.read()?;
        let (steal, all) = host_ticks()?;
        let (steal, all) = (
            steal.saturating_sub(self.host_start.0),
            all.saturating_sub(self.host_start.1),
        );
        let host_steal = (all > 0).then(|| steal as f64 / all as f64);
        if requests == 0 {
            return Ok(PerRequest {
                host_steal,
                ..PerRequest::default()
            });
        }
        let per = |spent: f64| spent / requests as f64;
        Ok(PerRequest {
            server: (!self.server_pids.is_empty()).then(|| per(server - self.start.0)),
            postgres: postgres.zip(self.start.1).map(|(after, before)| per(after - before)),
            client: Some(per(client - self.start.2)),
            processor: processor.zip(self.start.3).map(|(after, before)| per(after - before)),
            host_steal,
        })
    }
}
