//! The PNG charts: throughput against concurrency, latency percentiles, throughput against
//! key-table size. Categories on the x axis (the measured points), lines between them.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::summary::{beside_largest, cpu_groups, key, sizes, Groups};

struct Chart<'a> {
    file: &'a str,
    title: &'a str,
    x_label: &'a str,
    y_label: &'a str,
    categories: Vec<String>,
    /// One line per series; `None` where that point was not measured.
    series: Vec<(String, Vec<Option<f64>>)>,
}

pub fn draw(groups: &Groups, out: &Path, font: &'static [u8]) -> anyhow::Result<()> {
    register_font("sans-serif", FontStyle::Normal, font).map_err(|_| anyhow::anyhow!("the font is not TrueType"))?;
    let levels = [1u32, 8, 32, 64];
    let throughput =
        |side: &str, scenario: &str, c: u32, rows: u64| groups.get(&key(side, scenario, c, rows)).map(|g| g.throughput);
    let by_level = |f: &dyn Fn(u32) -> Option<f64>| levels.iter().map(|&c| f(c)).collect::<Vec<_>>();
    let charts = [
        Chart {
            file: "throughput_vs_concurrency.png",
            title: "New payments, 0 key rows",
            x_label: "concurrency",
            y_label: "per second",
            categories: levels.iter().map(u32::to_string).collect(),
            series: sides(groups)
                .into_iter()
                .map(|side| {
                    let points = by_level(&|c| throughput(&side, "new", c, 0));
                    (side, points)
                })
                .collect(),
        },
        Chart {
            file: "latency_percentiles.png",
            title: "New payments, latency, 0 key rows",
            x_label: "concurrency",
            y_label: "ms",
            categories: levels.iter().map(u32::to_string).collect(),
            series: ["p50", "p99", "p99.9"]
                .iter()
                .flat_map(|q| {
                    ["oncepay", "pgbench"].map(|side| {
                        let pick = |c: u32| {
                            groups.get(&key(side, "new", c, 0)).map(|g| match *q {
                                "p50" => g.p50_ms,
                                "p99" => g.p99_ms,
                                _ => g.p999_ms,
                            })
                        };
                        (format!("{side} {q}"), by_level(&pick))
                    })
                })
                .collect(),
        },
        {
            let sizes = sizes(groups);
            let at = |side: &str, scenario: &str| sizes.iter().map(|&s| throughput(side, scenario, 32, s)).collect();
            // The empty table measured in the largest one's rounds: one point, above the largest
            // size, which says what the machine did in those minutes without the rows.
            let beside = |side: &str| {
                let last = sizes.len().saturating_sub(1);
                (0..sizes.len())
                    .map(|i| beside_largest(groups, side).filter(|_| i == last).map(|g| g.throughput))
                    .collect()
            };
            Chart {
                file: "throughput_vs_key_rows.png",
                title: "Throughput against key-table size, concurrency 32",
                x_label: "rows in idempotency_keys (pre-filled)",
                y_label: "per second",
                categories: sizes.iter().map(u64::to_string).collect(),
                series: vec![
                    ("pgbench new".into(), at("pgbench", "new")),
                    ("oncepay new".into(), at("oncepay", "new")),
                    ("pgbench replay".into(), at("pgbench", "replay")),
                    ("oncepay replay".into(), at("oncepay", "replay")),
                    ("pgbench new, empty table, same rounds".into(), beside("pgbench")),
                    ("oncepay new, empty table, same rounds".into(), beside("oncepay")),
                ],
            }
        },
    ];
    for chart in &charts {
        render(chart, &out.join(chart.file))?;
    }
    cpu_bars(groups, &out.join("cpu_per_request.png"))
}

/// Stacked bars: CPU ms per request of oncepay, PostgreSQL and the load generator, for each
/// scenario and side at c=32 (the report's CPU table).
fn cpu_bars(groups: &Groups, path: &Path) -> anyhow::Result<()> {
    let bars: Vec<(String, [f64; 3])> = cpu_groups(groups)
        .into_iter()
        .filter_map(|(k, g)| {
            Some((
                format!("{}: {}", k.scenario, k.side.replace("oncepay x3 cache", "cache")),
                g.cpu_split()?,
            ))
        })
        .collect();
    let root = BitMapBackend::new(path, (1400, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let top = bars
        .iter()
        .map(|(_, p)| p.iter().sum::<f64>())
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.2;
    let n = bars.len().max(1);
    let mut ctx = ChartBuilder::on(&root)
        .caption("CPU per request, c=32 (ms): who spends the machine", ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(70)
        .y_label_area_size(72)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0.0..top)?;
    let labels: Vec<String> = bars.iter().map(|(l, _)| l.clone()).collect();
    ctx.configure_mesh()
        .disable_x_mesh()
        .y_desc("CPU ms per request")
        .x_labels(n)
        .x_label_formatter(&|x| category(&labels, *x))
        .label_style(("sans-serif", 12))
        .draw()?;
    let parts = ["oncepay", "PostgreSQL", "load generator"];
    for (part, name) in parts.iter().enumerate() {
        let color = Palette99::pick(part).to_rgba();
        ctx.draw_series(bars.iter().enumerate().map(|(i, (_, split))| {
            let below: f64 = split[..part].iter().sum();
            let x = i as f64;
            Rectangle::new([(x - 0.35, below), (x + 0.35, below + split[part])], color.filled())
        }))?
        .label(*name)
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
    }
    ctx.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()?;
    root.present()?;
    Ok(())
}

/// Every side measured on new payments at 0 key rows (pgbench, oncepay, its variants).
fn sides(groups: &Groups) -> Vec<String> {
    let mut sides: Vec<String> = groups
        .keys()
        .filter(|k| k.scenario == "new" && k.key_rows == 0)
        .map(|k| k.side.clone())
        .collect();
    sides.sort();
    sides.dedup();
    sides
}

fn render(chart: &Chart<'_>, path: &Path) -> anyhow::Result<()> {
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let top = chart
        .series
        .iter()
        .flat_map(|(_, points)| points.iter().flatten())
        .fold(0.0f64, |a, &b| a.max(b))
        .max(1e-3)
        * 1.15;
    let n = chart.categories.len().max(1);
    let mut ctx = ChartBuilder::on(&root)
        .caption(chart.title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0.0..top)?;
    let categories = chart.categories.clone();
    ctx.configure_mesh()
        .x_desc(chart.x_label)
        .y_desc(chart.y_label)
        .x_labels(n)
        .x_label_formatter(&|x| category(&categories, *x))
        .label_style(("sans-serif", 15))
        .draw()?;
    for (i, (name, points)) in chart.series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let xy: Vec<(f64, f64)> = points
            .iter()
            .enumerate()
            .filter_map(|(x, y)| y.map(|y| (x as f64, y)))
            .collect();
        if xy.is_empty() {
            continue;
        }
        ctx.draw_series(LineSeries::new(xy.clone(), color.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        ctx.draw_series(xy.into_iter().map(|p| Circle::new(p, 4, color.filled())))?;
    }
    ctx.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()?;
    root.present()?;
    Ok(())
}

/// The label of the category at x (the axis' whole numbers); nothing between them.
fn category(labels: &[String], x: f64) -> String {
    let i = x.round();
    if (x - i).abs() < 1e-6 && i >= 0.0 {
        labels.get(i as usize).cloned().unwrap_or_default()
    } else {
        String::new()
    }
}
