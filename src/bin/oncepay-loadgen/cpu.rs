//! CPU time of the server processes, from /proc/<pid>/stat (utime + stime).

use anyhow::Context;

/// Total user + system CPU seconds of `pids` so far.
pub fn seconds(pids: &[u32], clock_ticks_per_sec: u32) -> anyhow::Result<f64> {
    let mut ticks = 0u64;
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("no process {pid}"))?;
        // The command name (field 2) may hold spaces; the numeric fields follow its ')'.
        let rest = stat.rsplit_once(')').map(|(_, r)| r).context("unreadable stat")?;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // After ')' the first field is field 3 (state): utime is field 14, stime field 15.
        for index in [11, 12] {
            ticks += fields
                .get(index)
                .and_then(|f| f.parse::<u64>().ok())
                .context("unreadable utime/stime")?;
        }
    }
    Ok(ticks as f64 / f64::from(clock_ticks_per_sec))
}
