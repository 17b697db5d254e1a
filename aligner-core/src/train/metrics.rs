//! `metrics.jsonl` rows and the end-of-run SVG plot.

use std::io::Write;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde_json::{Map, Value};

use crate::error::{CoreError, Result};

/// Appends one JSON object per logged step to `metrics.jsonl`.
pub struct MetricsLog {
    path: PathBuf,
    /// Only rank 0 of a data-parallel run writes; the others' log is silent.
    enabled: bool,
}

impl MetricsLog {
    /// The run's log: [`MetricsLog::open`] on rank 0, a silent one on the other ranks.
    pub fn for_run(run: &crate::run::RunDir, keep_through_step: Option<usize>) -> Result<Self> {
        if run.is_writer() {
            Self::open(run.path(), keep_through_step)
        } else {
            Ok(Self {
                path: run.join("metrics.jsonl"),
                enabled: false,
            })
        }
    }

    /// Opens `dir/metrics.jsonl`, dropping rows after `keep_through_step` (rows a killed run
    /// wrote past its last checkpoint), so a resumed run continues the file exactly.
    pub fn open(dir: &Path, keep_through_step: Option<usize>) -> Result<Self> {
        let path = dir.join("metrics.jsonl");
        let kept: String = match (std::fs::read_to_string(&path), keep_through_step) {
            (Ok(text), Some(limit)) => text
                .lines()
                .filter(|l| {
                    serde_json::from_str::<Value>(l)
                        .ok()
                        .and_then(|v| v.get("step").and_then(Value::as_u64))
                        .is_some_and(|s| s as usize <= limit)
                })
                .map(|l| format!("{l}\n"))
                .collect(),
            _ => String::new(),
        };
        std::fs::write(&path, kept).map_err(|e| CoreError::cannot_write(&path, e))?;
        Ok(Self { path, enabled: true })
    }

    /// Appends a row.
    pub fn write(&self, row: &Map<String, Value>) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.path)
            .map_err(|e| CoreError::cannot_write(&self.path, e))?;
        writeln!(file, "{}", Value::Object(row.clone())).map_err(|e| CoreError::cannot_write(&self.path, e))
    }

    /// Every row written so far (none on a silent log).
    pub fn rows(&self) -> Result<Vec<Map<String, Value>>> {
        if !self.enabled {
            return Ok(Vec::new());
        }
        let text = std::fs::read_to_string(&self.path).map_err(|e| CoreError::io(&self.path, e))?;
        Ok(text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter_map(|v| v.as_object().cloned())
            .collect())
    }
}

/// Draws `keys` against `step` from `rows` into an SVG, one panel per key.
pub fn plot_metrics(rows: &[Map<String, Value>], keys: &[&str], path: &Path) -> Result<()> {
    let series: Vec<(&str, Vec<(f64, f64)>)> = keys
        .iter()
        .map(|k| {
            let points = rows
                .iter()
                .filter_map(|r| Some((r.get("step")?.as_f64()?, r.get(*k)?.as_f64()?)))
                .filter(|(_, y)| y.is_finite())
                .collect();
            (*k, points)
        })
        .filter(|(_, p): &(&str, Vec<(f64, f64)>)| !p.is_empty())
        .collect();
    if series.is_empty() {
        return Ok(());
    }
    let err = |e: String| CoreError::Invalid(format!("plot {}: {e}", path.display()));
    let root = SVGBackend::new(path, (720, 300 * series.len() as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    for (area, (name, points)) in root.split_evenly((series.len(), 1)).iter().zip(&series) {
        let (x0, x1) = points
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
        let (y0, y1) = points
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
        let pad = ((y1 - y0) * 0.05).max(1e-6);
        let mut chart = ChartBuilder::on(area)
            .caption(*name, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(x0..x1.max(x0 + 1.0), (y0 - pad)..(y1 + pad))
            .map_err(|e| err(e.to_string()))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .draw()
            .map_err(|e| err(e.to_string()))?;
        chart
            .draw_series(LineSeries::new(points.iter().copied(), &BLUE))
            .map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))
}
