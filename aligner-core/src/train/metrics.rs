//! `metrics.jsonl` rows (and the same scalars as TensorBoard events in `tb/`) and the
//! end-of-run SVG plot.

use std::io::Write;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde_json::{Map, Value};

use crate::error::{CoreError, Result};
use crate::train::tensorboard::EventWriter;

/// Appends one JSON object per logged step to `metrics.jsonl`, and its numbers as scalars
/// (its `text/...` strings as text summaries, which metrics.jsonl leaves out) to a TensorBoard
/// event file in `tb/`.
pub struct MetricsLog {
    path: PathBuf,
    /// Only rank 0 of a data-parallel run writes; the others' log is silent.
    enabled: bool,
    tensorboard: Option<EventWriter>,
}

/// Row keys with this prefix hold text for TensorBoard (sample responses), not metrics.
pub const TEXT_PREFIX: &str = "text/";

/// Row keys of what the device's allocator holds at a logged step's end, in MiB: the bytes
/// that live tensors use (`device_memory_mib`: the models, optimizer state and caches a step
/// keeps) and what the allocator has reserved for them (`device_reserved_mib`). Only GPU
/// backends (wgpu, CUDA) report them; on the CPU the row has neither.
pub fn device_memory(device: &burn::tensor::Device) -> Map<String, Value> {
    let mut row = Map::new();
    if let Some(usage) = device.memory_pool_usage() {
        let mib = |bytes: u64| Value::from(bytes as f64 / (1024.0 * 1024.0));
        row.insert("device_memory_mib".into(), mib(usage.bytes_in_use));
        row.insert("device_reserved_mib".into(), mib(usage.bytes_reserved));
    }
    row
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
                tensorboard: None,
            })
        }
    }

    /// The run's log with TensorBoard events in `<run>/tb/` when `tensorboard` is set.
    pub fn for_run_with_tensorboard(
        run: &crate::run::RunDir,
        keep_through_step: Option<usize>,
        tensorboard: bool,
    ) -> Result<Self> {
        let mut log = Self::for_run(run, keep_through_step)?;
        if let (true, Some(limit)) = (log.enabled, keep_through_step) {
            // Earlier event files drop what metrics.jsonl drops, so each step is there once.
            crate::train::tensorboard::keep_through(&run.join("tb"), limit as i64)?;
        }
        if log.enabled && tensorboard {
            log.tensorboard = Some(EventWriter::create(&run.join("tb"))?);
        }
        Ok(log)
    }

    /// Opens `dir/metrics.jsonl`, dropping rows after `keep_through_step` (rows a killed run
    /// wrote past its last checkpoint), so a resumed run continues the file exactly.
    pub fn open(dir: &Path, keep_through_step: Option<usize>) -> Result<Self> {
        let path = dir.join("metrics.jsonl");
        let kept: String = match (std::fs::read_to_string(&path), keep_through_step) {
            (Ok(text), Some(limit)) => text
                .lines()
                .filter(|l| row_step(l).is_some_and(|s| s <= limit as f64))
                .map(|l| format!("{l}\n"))
                .collect(),
            _ => String::new(),
        };
        std::fs::write(&path, kept).map_err(|e| CoreError::cannot_write(&path, e))?;
        Ok(Self {
            path,
            enabled: true,
            tensorboard: None,
        })
    }

    /// Appends a row.
    pub fn write(&self, row: &Map<String, Value>) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let (texts, metrics): (Map<String, Value>, Map<String, Value>) = row
            .clone()
            .into_iter()
            .partition(|(k, _)| k.starts_with(TEXT_PREFIX));
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.path)
            .map_err(|e| CoreError::cannot_write(&self.path, e))?;
        writeln!(file, "{}", Value::Object(metrics.clone()))
            .map_err(|e| CoreError::cannot_write(&self.path, e))?;
        if let Some(tb) = &self.tensorboard {
            let step = metrics.get("step").and_then(Value::as_f64).unwrap_or(0.0) as i64;
            let scalars: Vec<(&str, f64)> = metrics
                .iter()
                .filter(|(k, _)| k.as_str() != "step")
                .filter_map(|(k, v)| Some((k.as_str(), v.as_f64()?)))
                .collect();
            let texts: Vec<(&str, &str)> = texts
                .iter()
                .filter_map(|(k, v)| Some((&k[TEXT_PREFIX.len()..], v.as_str()?)))
                .collect();
            tb.write_step(step, &scalars, &texts)?;
        }
        Ok(())
    }

    /// The value of `key` in the row of `step` written so far (a resumed run's step-0
    /// evaluation, for its summary); `None` on a silent log.
    pub fn logged(&self, step: usize, key: &str) -> Result<Option<f64>> {
        Ok(self
            .rows()?
            .iter()
            .filter(|r| r.get("step").and_then(Value::as_f64) == Some(step as f64))
            .find_map(|r| r.get(key)?.as_f64()))
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

/// The `step` of a metrics.jsonl line, written as an integer or (PPO's step-0 evaluation row,
/// built from f64 values) as a float.
fn row_step(line: &str) -> Option<f64> {
    serde_json::from_str::<Value>(line).ok()?.get("step")?.as_f64()
}

/// Draws `keys` against `step` from `rows` into an SVG, one panel per key.
pub fn plot_metrics(rows: &[Map<String, Value>], keys: &[&str], path: &Path) -> Result<()> {
    plot_runs(&[("", rows)], keys, path)
}

/// Draws `keys` against `step` for several runs (`(label, rows)`) into one SVG: one panel
/// per key, one line per run, a legend naming the runs (`aligner plot`).
pub fn plot_runs(runs: &[(&str, &[Map<String, Value>])], keys: &[&str], path: &Path) -> Result<()> {
    // Per key, the runs that have it, each with its points.
    type Lines<'a> = Vec<(&'a str, Vec<(f64, f64)>)>;
    let panels: Vec<(&str, Lines)> = keys
        .iter()
        .map(|k| {
            let lines: Lines = runs
                .iter()
                .map(|(label, rows)| {
                    let points = rows
                        .iter()
                        .filter_map(|r| Some((r.get("step")?.as_f64()?, r.get(*k)?.as_f64()?)))
                        .filter(|(_, y)| y.is_finite())
                        .collect();
                    (*label, points)
                })
                .filter(|(_, p): &(&str, Vec<(f64, f64)>)| !p.is_empty())
                .collect();
            (*k, lines)
        })
        .filter(|(_, lines)| !lines.is_empty())
        .collect();
    if panels.is_empty() {
        return Ok(());
    }
    let err = |e: String| CoreError::Invalid(format!("plot {}: {e}", path.display()));
    let root = SVGBackend::new(path, (720, 300 * panels.len() as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    for (area, (name, lines)) in root.split_evenly((panels.len(), 1)).iter().zip(&panels) {
        let all = lines.iter().flat_map(|(_, p)| p.iter());
        let (x0, x1, y0, y1) = all.fold((f64::MAX, f64::MIN, f64::MAX, f64::MIN), |(a, b, c, d), p| {
            (a.min(p.0), b.max(p.0), c.min(p.1), d.max(p.1))
        });
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
        for (i, (label, points)) in lines.iter().enumerate() {
            let color = match runs.len() {
                1 => BLUE.to_rgba(),
                _ => Palette99::pick(i).to_rgba(),
            };
            let drawn = chart
                .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
                .map_err(|e| err(e.to_string()))?;
            if !label.is_empty() {
                drawn
                    .label(label.to_string())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
            }
        }
        if lines.iter().any(|(label, _)| !label.is_empty()) {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()
                .map_err(|e| err(e.to_string()))?;
        }
    }
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// Draws labelled `(x, y)` series on one chart (`(caption, x label, y label)`) into an SVG:
/// a line through each series of more than one point, a dot at every point, a legend naming
/// the series (`aligner eval --plot`'s reward–KL chart). The x axis starts at 0 or below.
pub fn plot_points(series: &[(&str, &[(f64, f64)])], labels: (&str, &str, &str), path: &Path) -> Result<()> {
    let all: Vec<(f64, f64)> = series.iter().flat_map(|s| s.1.iter().copied()).collect();
    if all.is_empty() {
        return Err(CoreError::Invalid(format!(
            "plot {}: no points to draw",
            path.display()
        )));
    }
    let (caption, x_desc, y_desc) = labels;
    let (x0, x1, y0, y1) = all
        .iter()
        .fold((0.0f64, f64::MIN, f64::MAX, f64::MIN), |(a, b, c, d), p| {
            (a.min(p.0), b.max(p.0), c.min(p.1), d.max(p.1))
        });
    let pad = ((y1 - y0) * 0.1).max(0.1);
    let err = |e: String| CoreError::Invalid(format!("plot {}: {e}", path.display()));
    let root = SVGBackend::new(path, (800, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(x0..(x1 * 1.1).max(x0 + 1.0), (y0 - pad)..(y1 + pad))
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, (label, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        if points.len() > 1 {
            chart
                .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
                .map_err(|e| err(e.to_string()))?;
        }
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| err(e.to_string()))?
            .label(label.to_string())
            .legend(move |(x, y)| Circle::new((x, y), 4, color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_log_keeps_every_row_up_to_its_checkpoint_float_steps_included() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        std::fs::write(
            &path,
            "{\"step\":0.0,\"eval_reward\":1.0}\n{\"step\":1,\"loss\":2.0}\n{\"step\":2,\"loss\":1.0}\n\
             {\"step\":3,\"loss\":0.5}\n{\"step\":3.0,\"eval_reward\":2.0}\nnot json\n",
        )
        .unwrap();
        let log = MetricsLog::open(dir.path(), Some(2)).unwrap();
        let steps: Vec<f64> = log
            .rows()
            .unwrap()
            .iter()
            .map(|r| r["step"].as_f64().unwrap())
            .collect();
        assert_eq!(steps, [0.0, 1.0, 2.0]);
        assert_eq!(log.logged(0, "eval_reward").unwrap(), Some(1.0));
        assert_eq!(log.logged(3, "eval_reward").unwrap(), None);
        // A new run starts an empty file.
        assert!(
            MetricsLog::open(dir.path(), None)
                .unwrap()
                .rows()
                .unwrap()
                .is_empty()
        );
    }
}
