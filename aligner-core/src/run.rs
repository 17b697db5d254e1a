//! The run folder, written once for every method: its layout (`config.toml`, `metrics.jsonl`,
//! `checkpoints/step-N/` written under a temporary name and renamed, `final/`), resuming from
//! the newest complete checkpoint, the data files of `[data]`, and the progress bar. What a run
//! starts from (its model, and how it saves it) is in [`crate::start`].
//!
//! A method's library entry point takes its typed config, a [`RunDir`] and a device:
//!
//! ```no_run
//! use aligner_core::run::RunDir;
//! use aligner_core::sft::{SftConfig, train};
//! let summary = train(&SftConfig::default(), &RunDir::new("runs/sft"), &aligner_core::Device::flex()).unwrap();
//! println!("{} steps, model in {}", summary.steps, summary.final_dir.display());
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use aligner_parallel::Communicator;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{CoreError, Result};
use crate::train::config::{DataSection, to_toml};

/// Where a run writes, whether it continues an earlier one, and the process group it runs in.
///
/// With several data-parallel ranks, only rank 0 writes the folder (configuration, metrics,
/// checkpoints, `final/`); the folder must be one every rank reads (a shared filesystem when
/// ranks span nodes), since every rank resumes from the checkpoint rank 0 chose.
#[derive(Clone)]
pub struct RunDir {
    path: PathBuf,
    resume: bool,
    /// A new run may clear a folder that already holds a run (`--overwrite`).
    overwrite: bool,
    stop_after: Option<usize>,
    /// Test hook: the last rank aborts (no cleanup, as if killed) at this step.
    abort_after: Option<usize>,
    /// A resumed run's `config_changes.jsonl` row (`--allow-change`), appended only once a
    /// checkpoint to resume from is known intact.
    changes: Option<serde_json::Value>,
    /// Every rank of the run: rank 0 writes the folder.
    world: Arc<dyn Communicator>,
    /// The data-parallel ranks (the world, unless tensor groups split it): work and data are
    /// split over them and gradients summed.
    comm: Arc<dyn Communicator>,
    /// This rank's tensor group (`parallel.tensor`), when the model is split over one.
    tensor: Option<Arc<dyn Communicator>>,
}

/// The file each checkpoint lists its files in, with their sizes and CRC-32C, so a damaged
/// checkpoint is found before it is loaded.
pub const MANIFEST: &str = "manifest.json";

impl std::fmt::Debug for RunDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunDir")
            .field("path", &self.path)
            .field("resume", &self.resume)
            .field("overwrite", &self.overwrite)
            .field("stop_after", &self.stop_after)
            .field("rank", &self.world.rank())
            .field("world_size", &self.world.world_size())
            .finish()
    }
}

impl PartialEq for RunDir {
    fn eq(&self, other: &Self) -> bool {
        (&self.path, self.resume, self.stop_after) == (&other.path, other.resume, other.stop_after)
    }
}

impl RunDir {
    /// A new run into `path`, in the process group [`aligner_parallel::world`].
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            resume: false,
            overwrite: false,
            stop_after: None,
            abort_after: None,
            changes: None,
            world: aligner_parallel::world(),
            comm: aligner_parallel::world(),
            tensor: None,
        }
    }

    /// The same run in another process group (no tensor groups).
    pub fn with_comm(mut self, comm: Arc<dyn Communicator>) -> Self {
        self.world = comm.clone();
        self.comm = comm;
        self.tensor = None;
        self
    }

    /// The run with its ranks in a `data × tensor` grid of `tensor` ranks per tensor group
    /// (`parallel.tensor`; a collective, refused when `tensor` does not divide the ranks):
    /// [`RunDir::comm`] becomes the data-parallel ranks, [`RunDir::tensor_group`] the group.
    /// `tensor = 1` changes nothing.
    pub fn in_tensor_groups(mut self, tensor: usize) -> Result<Self> {
        if tensor <= 1 {
            return Ok(self);
        }
        let grid = aligner_parallel::Grid::split(self.world.as_ref(), tensor)
            .map_err(|e| CoreError::Invalid(e.to_string().replace("communicator: ", "")))?;
        self.comm = grid.data;
        self.tensor = Some(grid.tensor);
        Ok(self)
    }

    /// The data-parallel ranks the run trains on: work and data are split over them and their
    /// gradients summed (every rank, unless [`RunDir::in_tensor_groups`] made tensor groups:
    /// then the ranks of the other groups that hold the same part of the model).
    pub fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    /// [`RunDir::comm`], shared (what a fully sharded parameter's collectives run on).
    pub fn comm_handle(&self) -> Arc<dyn Communicator> {
        self.comm.clone()
    }

    /// This rank's tensor group (`parallel.tensor` > 1), which splits the model's layers.
    pub fn tensor_group(&self) -> Option<Arc<dyn Communicator>> {
        self.tensor.clone()
    }

    /// Every rank of the run.
    pub fn world(&self) -> &dyn Communicator {
        self.world.as_ref()
    }

    /// Whether this process writes the run folder (rank 0).
    pub fn is_writer(&self) -> bool {
        self.world.is_root()
    }

    /// Rank 0's `value` on every rank (a decision every rank must share).
    pub fn agree<T: Serialize + DeserializeOwned>(&self, value: &T) -> Result<T> {
        crate::parallel::broadcast_from_root(self.world(), value)
    }

    /// The run in `path`, continued from its newest checkpoint.
    pub fn resuming(path: impl Into<PathBuf>) -> Self {
        Self {
            resume: true,
            ..Self::new(path)
        }
    }

    /// A resumed run's row for `config_changes.jsonl` (the settings `--allow-change` let a
    /// `--set` change), appended by [`RunDir::start`] once the run is known to resume.
    pub fn recording_changes(mut self, row: serde_json::Value) -> Self {
        self.changes = Some(row);
        self
    }

    /// Whether a new run may clear a folder that already holds a run (`--overwrite`); without
    /// it, [`RunDir::start`] refuses such a folder rather than mixing two runs in it.
    pub fn overwrite(mut self, yes: bool) -> Self {
        self.overwrite = yes;
        self
    }

    /// Stops after `steps` optimiser steps as if interrupted (checkpoints stay resumable);
    /// for tests of resume.
    pub fn stop_after(mut self, steps: Option<usize>) -> Self {
        self.stop_after = steps;
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `path/name`.
    pub fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.path.join(name)
    }

    pub fn is_resumed(&self) -> bool {
        self.resume
    }

    /// Aborts at `steps` optimiser steps as if killed (`kill -9`: no checkpoint, no cleanup, no
    /// final save), on the last rank only, so that with several ranks the launcher takes the
    /// others down; for tests of resume after a crash at a known step, instead of racing a
    /// running job with a signal.
    pub fn abort_after(mut self, steps: Option<usize>) -> Self {
        self.abort_after = steps;
        self
    }

    /// Whether the loop stops before step `step` (from 0) for [`RunDir::stop_after`]; aborts
    /// the process there for [`RunDir::abort_after`]. Every training loop asks before each step.
    pub fn stops_at(&self, step: usize) -> bool {
        if self.abort_after.is_some_and(|s| step >= s) && self.world.rank() + 1 == self.world.world_size() {
            tracing::error!(step, "aborting as asked (--abort-after)");
            std::process::abort();
        }
        self.stop_after.is_some_and(|s| step >= s)
    }

    /// A run inside this one in `path/name` (PPO's reward model, SteerLM bootstrap's earlier
    /// steps, a SPIN iteration, a rejection-sampling round): a new run, stopped nowhere. This
    /// run owns the folder, so what an interrupted attempt left there is replaced.
    pub fn child(&self, name: &str) -> Self {
        Self {
            world: self.world.clone(),
            comm: self.comm.clone(),
            tensor: self.tensor.clone(),
            ..Self::new(self.join(name))
        }
        .overwrite(true)
    }

    /// Claims the folder for a new run (a resumed one keeps it) and writes the resolved
    /// configuration as `config.toml` (rank 0). A folder that already holds files is refused
    /// unless the run may overwrite, and then only when it is a run folder.
    pub fn start<T: Serialize>(&self, config: &T) -> Result<()> {
        self.start_with_steps(config, &[])
    }

    /// [`RunDir::start`] for a run whose earlier steps may already be in its folder as
    /// `steps` (SteerLM bootstrap's `sft` and `attributes`, PPO's `reward_model`): those are
    /// its inputs, reused when finished, so they neither count as an earlier run nor are
    /// cleared by `--overwrite`.
    pub fn start_with_steps<T: Serialize>(&self, config: &T, steps: &[&str]) -> Result<()> {
        if !self.is_writer() {
            return Ok(());
        }
        if self.resume {
            // A resume whose checkpoints are all damaged changes nothing in the folder. (A run
            // that resumes by stage, SPIN's iterations or SteerLM's steps, has none of its own.)
            if let (None, damaged) = self.newest_intact(None)
                && !damaged.is_empty()
            {
                return Err(self.nothing_to_resume(&damaged));
            }
        } else {
            self.claim(steps)?;
        }
        std::fs::create_dir_all(&self.path).map_err(|e| CoreError::cannot_write(&self.path, e))?;
        crate::checkpoint::write_atomic(&self.join("config.toml"), to_toml(config)?.as_bytes())?;
        if let Some(row) = &self.changes {
            crate::data::append_jsonl(&self.join("config_changes.jsonl"), row)?;
        }
        Ok(())
    }

    /// An empty (or missing) folder for a new run, `steps` aside: another run's files are
    /// cleared when the run may overwrite, else refused; a folder of other files is never
    /// cleared.
    fn claim(&self, steps: &[&str]) -> Result<()> {
        let found: Vec<String> = match std::fs::read_dir(&self.path) {
            Ok(entries) => entries
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| !steps.contains(&name.as_str()))
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
                return Err(CoreError::Invalid(format!(
                    "run folder {} is a file, not a folder",
                    self.path.display()
                )));
            }
            Err(e) => return Err(CoreError::io(&self.path, e)),
        };
        // A run that stopped before it did anything (a bad value found after the folder was
        // claimed) left only its config.toml: nothing is lost by starting over.
        if found.iter().all(|name| name == "config.toml") {
            return Ok(());
        }
        let mut listed = found.clone();
        listed.sort();
        listed.truncate(6);
        let path = self.path.display();
        let is_run = ["config.toml", "metrics.jsonl", "checkpoints", "final"]
            .iter()
            .any(|name| found.iter().any(|f| f == name));
        if !is_run {
            return Err(CoreError::Invalid(format!(
                "run folder {path} is not empty and holds no run (it has {}): choose an empty or new folder with --out",
                listed.join(", ")
            )));
        }
        if !self.overwrite {
            return Err(CoreError::Invalid(format!(
                "run folder {path} already holds a run ({}): pass --overwrite to replace it, \
                 --resume {path} to continue it, or --out to choose another folder",
                listed.join(", ")
            )));
        }
        tracing::warn!(run = %path, "--overwrite: clearing the earlier run in the folder");
        for name in found {
            let entry = self.join(&name);
            let removed = match entry.is_dir() {
                true => std::fs::remove_dir_all(&entry),
                false => std::fs::remove_file(&entry),
            };
            removed.map_err(|e| CoreError::cannot_write(&entry, e))?;
        }
        Ok(())
    }

    /// Before training starts: removes the temporary folders of checkpoints that were being
    /// written when a run was killed, and, for a new run, checkpoints an earlier attempt in
    /// this folder left (a child run whose parent owns the folder), so no stale checkpoint can
    /// be resumed later (rank 0).
    pub fn prepare_checkpoints(&self) -> Result<()> {
        if !self.is_writer() {
            return Ok(());
        }
        let dir = self.checkpoints();
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Ok(());
        };
        for entry in entries.filter_map(|e| e.ok()) {
            let name = entry.file_name().to_string_lossy().into_owned();
            // A killed save's folder, or a rank's staged optimizer state (`.tmp-rank-R-...`).
            let stale = name.starts_with(".tmp-") || (!self.resume && name.starts_with("step-"));
            if stale {
                let path = entry.path();
                match path.is_dir() {
                    true => std::fs::remove_dir_all(&path),
                    false => std::fs::remove_file(&path),
                }
                .map_err(|e| CoreError::cannot_write(&path, e))?;
            }
        }
        Ok(())
    }

    /// Writes `name` in the run folder with `write` on rank 0 only; every rank returns once
    /// it is written.
    pub fn write_shared<E: From<CoreError>>(
        &self,
        write: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let outcome = if self.is_writer() { write() } else { Ok(()) };
        // Every rank waits, so a file rank 0 wrote is there for the others to read.
        self.world.barrier().map_err(CoreError::from)?;
        outcome
    }

    /// The final model of the step `name` that this run makes first (PPO's reward model,
    /// SteerLM bootstrap's earlier steps), a run of its own in `path/name`: trained now by
    /// `train` unless a finished one is there (a resumed run), `last_written` being the file the
    /// step writes last into its final model.
    pub fn earlier_step<E: From<CoreError>>(
        &self,
        name: &str,
        last_written: &str,
        train: impl FnOnce(&RunDir) -> std::result::Result<(), E>,
    ) -> std::result::Result<PathBuf, E> {
        let step = self.child(name);
        let done = self
            .agree(&step.final_dir().join(last_written).exists())
            .map_err(E::from)?;
        if !done {
            tracing::info!(run = %step.path().display(), "training the {name} step with its defaults first");
            train(&step)?;
        }
        Ok(step.final_dir())
    }

    pub fn checkpoints(&self) -> PathBuf {
        self.join("checkpoints")
    }

    /// `final/`: the trained model as a HF folder.
    pub fn final_dir(&self) -> PathBuf {
        self.join("final")
    }

    /// The newest complete checkpoint: the `checkpoints/step-N` with the highest `N` that holds
    /// `marker` (the file a checkpoint writes last).
    pub fn latest_checkpoint(&self, marker: &str) -> Option<(usize, PathBuf)> {
        self.checkpoint_dirs(Some(marker))
            .into_iter()
            .max_by_key(|(step, _)| *step)
    }

    /// Where a run starts: `None` for a new run, the newest intact checkpoint for a resumed
    /// one (an error when it has none). A newer checkpoint whose files do not match its
    /// manifest is passed over with a warning naming what is damaged. Rank 0 chooses, so
    /// every rank resumes from the same checkpoint.
    pub fn resume_point(&self, marker: &str) -> Result<Option<(usize, PathBuf)>> {
        if !self.resume {
            return Ok(None);
        }
        let (chosen, damaged) = match self.is_writer() {
            true => self.newest_intact(Some(marker)),
            false => (None, Vec::new()),
        };
        let step = self.agree(&chosen.map(|(step, _)| step))?;
        match step.map(|s| (s, self.checkpoints().join(format!("step-{s}")))) {
            Some(point) => {
                for why in &damaged {
                    tracing::warn!("passed over checkpoint {why}");
                }
                Ok(Some(point))
            }
            None => Err(self.nothing_to_resume(&damaged)),
        }
    }

    /// The newest checkpoint whose files match its manifest (holding `marker`, when given),
    /// and what is damaged in each newer one (`step-N: why`). Older checkpoints are not read.
    fn newest_intact(&self, marker: Option<&str>) -> (Option<(usize, PathBuf)>, Vec<String>) {
        let mut found = self.checkpoint_dirs(marker);
        found.sort_by_key(|(step, _)| std::cmp::Reverse(*step));
        let mut damaged = Vec::new();
        for (step, dir) in found {
            match verify_manifest(&dir) {
                Ok(()) => return (Some((step, dir)), damaged),
                Err(why) => damaged.push(format!("step-{step}: {why}")),
            }
        }
        (None, damaged)
    }

    /// Every `checkpoints/step-N` folder (holding `marker`, when given), in no order.
    fn checkpoint_dirs(&self, marker: Option<&str>) -> Vec<(usize, PathBuf)> {
        let Ok(entries) = std::fs::read_dir(self.checkpoints()) else {
            return Vec::new();
        };
        entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let step = name.strip_prefix("step-")?.parse::<usize>().ok()?;
                let complete = marker.is_none_or(|m| e.path().join(m).exists());
                complete.then(|| (step, e.path()))
            })
            .collect()
    }

    /// Why `--resume` cannot continue the run: no checkpoint, or each one's damage.
    fn nothing_to_resume(&self, damaged: &[String]) -> CoreError {
        CoreError::Invalid(match damaged.is_empty() {
            true => format!("--resume: no checkpoint in {}", self.checkpoints().display()),
            false => format!(
                "--resume: no intact checkpoint in {} ({}); nothing in the run folder was changed",
                self.checkpoints().display(),
                damaged.join("; ")
            ),
        })
    }

    /// Writes `checkpoints/step-N/`: `write` fills a temporary folder, which is then renamed,
    /// so a save killed half-way leaves only a `.tmp-` folder and the previous checkpoints.
    /// `write`'s error type is the caller's (a method crate's own errors pass through). Only
    /// rank 0 writes; the other ranks return the folder's path at once.
    pub fn save_checkpoint<E: From<CoreError>>(
        &self,
        step: usize,
        write: impl FnOnce(&Path) -> std::result::Result<(), E>,
    ) -> std::result::Result<PathBuf, E> {
        let dir = self.checkpoints();
        let final_dir = dir.join(format!("step-{step}"));
        if !self.is_writer() {
            return Ok(final_dir);
        }
        let tmp = dir.join(format!(".tmp-step-{step}"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| CoreError::cannot_write(&tmp, e))?;
        write(&tmp)?;
        write_manifest(&tmp)?;
        let _ = std::fs::remove_dir_all(&final_dir);
        // The rename is the commit point.
        std::fs::rename(&tmp, &final_dir).map_err(|e| CoreError::cannot_write(&final_dir, e))?;
        Ok(final_dir)
    }
}

/// A checkpoint's files (relative paths, `/`-separated) with their sizes and CRC-32C.
#[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
struct Manifest {
    files: std::collections::BTreeMap<String, FileSum>,
}

#[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
struct FileSum {
    bytes: u64,
    crc32c: u32,
}

/// The files under `dir` (its manifest aside) and their sums.
fn sum_files(dir: &Path) -> Result<Manifest> {
    fn walk(root: &Path, dir: &Path, files: &mut std::collections::BTreeMap<String, FileSum>) -> Result<()> {
        for entry in std::fs::read_dir(dir).map_err(|e| CoreError::io(dir, e))? {
            let path = entry.map_err(|e| CoreError::io(dir, e))?.path();
            if path.is_dir() {
                walk(root, &path, files)?;
                continue;
            }
            let name = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            if name == MANIFEST {
                continue;
            }
            files.insert(name, sum_file(&path)?);
        }
        Ok(())
    }
    let mut files = std::collections::BTreeMap::new();
    walk(dir, dir, &mut files)?;
    Ok(Manifest { files })
}

/// `path`'s size and CRC-32C, read in 4 MiB pieces: a checkpoint's optimizer state is
/// several times the model, and its writer must not hold it whole a second time to sum it.
fn sum_file(path: &Path) -> Result<FileSum> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(|e| CoreError::io(path, e))?;
    let mut buffer = vec![0u8; 4 << 20];
    let (mut bytes, mut crc) = (0u64, 0u32);
    loop {
        let read = file.read(&mut buffer).map_err(|e| CoreError::io(path, e))?;
        if read == 0 {
            return Ok(FileSum { bytes, crc32c: crc });
        }
        crc = crc32c::crc32c_append(crc, &buffer[..read]);
        bytes += read as u64;
    }
}

/// Writes `dir/manifest.json` for the files `dir` holds.
fn write_manifest(dir: &Path) -> Result<()> {
    crate::checkpoint::write_json(&dir.join(MANIFEST), &sum_files(dir)?)
}

/// Whether the checkpoint `dir` holds exactly the files its manifest lists, unchanged; a
/// checkpoint from before manifests is taken as it is. The error says what differs.
fn verify_manifest(dir: &Path) -> std::result::Result<(), String> {
    let path = dir.join(MANIFEST);
    if !path.exists() {
        return Ok(());
    }
    let listed: Manifest = std::fs::read_to_string(&path)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .ok_or_else(|| format!("{} cannot be read", path.display()))?;
    let found = sum_files(dir).map_err(|e| e.to_string())?;
    for (name, sum) in &listed.files {
        match found.files.get(name) {
            None => return Err(format!("{name} is missing")),
            Some(f) if f.bytes != sum.bytes => {
                return Err(format!(
                    "{name} has {} bytes, the checkpoint wrote {}",
                    f.bytes, sum.bytes
                ));
            }
            Some(f) if f.crc32c != sum.crc32c => {
                return Err(format!("{name} does not match its checksum (changed or damaged)"));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// The model a run started from, for a model folder that is a run's `final/` (or any folder
/// inside a run): the `model.path` its `config.toml` records; `None` when the folder is not
/// in a run or the run started from the shipped model.
pub fn start_model_of(model_dir: &Path) -> Result<Option<PathBuf>> {
    let Some(config) = model_dir.parent().map(|run| run.join("config.toml")) else {
        return Ok(None);
    };
    if !config.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&config).map_err(|e| CoreError::io(&config, e))?;
    let table: toml::Table = toml::from_str(&text).map_err(|e| CoreError::Config {
        path: config.clone(),
        message: e.to_string(),
    })?;
    Ok(table
        .get("model")
        .and_then(|m| m.get("path"))
        .and_then(|p| p.as_str())
        .map(PathBuf::from))
}

/// A progress bar on stderr drawn with `template` (indicatif's syntax); hidden on every rank
/// but rank 0 of a data-parallel run.
pub fn progress_bar(len: u64, template: &str) -> indicatif::ProgressBar {
    if !aligner_parallel::world().is_root() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar
}

/// The files of a run's `[data]`: the training file (required) and the validation file (an
/// empty path, `--set data.validation=''`, turns validation off).
pub fn data_files(data: &DataSection) -> Result<DataFiles> {
    let train = data
        .train
        .clone()
        .ok_or_else(|| CoreError::Invalid("data.train is not set".into()))?;
    let validation = data.validation.clone().filter(|p| !p.as_os_str().is_empty());
    Ok(DataFiles {
        train,
        validation,
        fields: data.fields.clone(),
    })
}

/// The training file and, unless validation is off, the validation file of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct DataFiles {
    pub train: PathBuf,
    pub validation: Option<PathBuf>,
    /// `data.fields`: column renames applied to the rows of both files.
    pub fields: std::collections::BTreeMap<String, String>,
}

/// Which of a run's data files is being read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Train,
    Validation,
}

impl Split {
    /// `train` or `validation`: how the run folder names what it caches per split
    /// (`reference_train.jsonl`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Validation => "validation",
        }
    }
}

impl DataFiles {
    /// Both splits read with `load`; without a validation file the validation split is empty.
    pub fn load<T, E>(
        &self,
        mut load: impl FnMut(&Path, Split) -> std::result::Result<Vec<T>, E>,
    ) -> std::result::Result<(Vec<T>, Vec<T>), E> {
        let fields = &self.fields;
        let train = crate::data::with_fields(&self.train, fields, || load(&self.train, Split::Train))?;
        let validation = match &self.validation {
            Some(path) => crate::data::with_fields(path, fields, || load(path, Split::Validation))?,
            None => Vec::new(),
        };
        Ok((train, validation))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoints_commit_by_rename_and_the_newest_complete_one_wins() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        for step in [2, 10] {
            run.save_checkpoint::<CoreError>(step, |tmp| {
                crate::checkpoint::write_atomic(&tmp.join("state.json"), b"{}")
            })
            .unwrap();
        }
        // A save that failed half-way leaves no checkpoint behind.
        let failed: Result<_> = run.save_checkpoint(20, |_| Err(CoreError::Invalid("disk full".into())));
        assert!(failed.is_err());
        // One without the marker file is not complete.
        std::fs::create_dir_all(run.checkpoints().join("step-30")).unwrap();
        assert_eq!(run.latest_checkpoint("state.json").unwrap().0, 10);
        assert_eq!(run.resume_point("state.json").unwrap(), None);
        let resumed = RunDir::resuming(dir.path());
        assert_eq!(resumed.resume_point("state.json").unwrap().unwrap().0, 10);
        let err = resumed.resume_point("other.json").unwrap_err().to_string();
        assert!(err.contains("no checkpoint"), "{err}");
    }

    #[test]
    fn a_damaged_checkpoint_is_passed_over_and_a_resume_without_an_intact_one_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        run.start(&toml::Table::new()).unwrap();
        for step in [2, 4] {
            run.save_checkpoint::<CoreError>(step, |tmp| {
                std::fs::create_dir_all(tmp.join("actor")).unwrap();
                crate::checkpoint::write_atomic(&tmp.join("actor/model.safetensors"), &[step as u8; 64])?;
                crate::checkpoint::write_atomic(&tmp.join("state.json"), b"{}")
            })
            .unwrap();
        }
        let weights = |step: usize| {
            run.checkpoints()
                .join(format!("step-{step}/actor/model.safetensors"))
        };
        let resumed = RunDir::resuming(dir.path()).recording_changes(serde_json::json!({"changes": []}));
        assert_eq!(resumed.resume_point("state.json").unwrap().unwrap().0, 4);
        // Step 4's weights flipped a byte: step 2 is the newest intact checkpoint.
        let mut bytes = std::fs::read(weights(4)).unwrap();
        bytes[10] ^= 1;
        std::fs::write(weights(4), &bytes).unwrap();
        assert_eq!(resumed.resume_point("state.json").unwrap().unwrap().0, 2);
        // Step 2's cut short too: no resume, and nothing written.
        std::fs::write(weights(2), [2u8; 10]).unwrap();
        let config = std::fs::read(dir.path().join("config.toml")).unwrap();
        let mut changed = toml::Table::new();
        changed.insert("lr".into(), 1.0.into());
        let err = resumed.start(&changed).unwrap_err().to_string();
        assert!(
            err.contains("no intact checkpoint")
                && err.contains("step-4: actor/model.safetensors does not match its checksum")
                && err.contains("step-2: actor/model.safetensors has 10 bytes, the checkpoint wrote 64"),
            "{err}"
        );
        assert_eq!(std::fs::read(dir.path().join("config.toml")).unwrap(), config);
        assert!(!dir.path().join("config_changes.jsonl").exists());
        assert!(resumed.resume_point("state.json").is_err());
    }

    #[test]
    fn an_empty_validation_path_turns_validation_off() {
        let mut data = DataSection::shipped("a.jsonl", "b.jsonl");
        let files = data_files(&data).unwrap();
        let seen = |path: &Path, split: Split| Ok::<_, CoreError>(vec![(path.to_path_buf(), split)]);
        let (train, validation) = files.load(seen).unwrap();
        assert_eq!(train, vec![(files.train.clone(), Split::Train)]);
        assert_eq!(
            validation,
            vec![(files.validation.clone().unwrap(), Split::Validation)]
        );
        data.validation = Some(PathBuf::new());
        let files = data_files(&data).unwrap();
        assert_eq!(files.validation, None);
        assert_eq!(files.load(seen).unwrap().1, vec![]);
        data.train = None;
        assert!(data_files(&data).unwrap_err().to_string().contains("data.train"));
    }

    #[test]
    fn a_new_run_never_mixes_with_an_earlier_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run");
        let config = DataSection::default();
        RunDir::new(&path).start(&config).unwrap();
        let run = RunDir::new(&path);
        run.save_checkpoint::<CoreError>(40, |tmp| {
            crate::checkpoint::write_atomic(&tmp.join("state.json"), b"{}")
        })
        .unwrap();
        // A folder holding a run is refused unless the new run may overwrite it.
        let err = RunDir::new(&path).start(&config).unwrap_err().to_string();
        assert!(
            err.contains("already holds a run") && err.contains("--overwrite"),
            "{err}"
        );
        RunDir::new(&path).overwrite(true).start(&config).unwrap();
        assert!(
            !run.checkpoints().exists(),
            "the earlier run's checkpoints were cleared"
        );
        // A resumed run keeps its folder.
        RunDir::resuming(&path).start(&config).unwrap();
        assert!(path.join("config.toml").exists());
        // A folder of other files is never cleared.
        let other = dir.path().join("home");
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(other.join("notes.txt"), "keep").unwrap();
        let err = RunDir::new(&other)
            .overwrite(true)
            .start(&config)
            .unwrap_err()
            .to_string();
        assert!(err.contains("holds no run") && err.contains("notes.txt"), "{err}");
        assert!(other.join("notes.txt").exists());
    }

    #[test]
    fn interrupted_saves_and_stale_checkpoints_are_cleared_before_training() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        for step in [2, 4] {
            run.save_checkpoint::<CoreError>(step, |tmp| {
                crate::checkpoint::write_atomic(&tmp.join("s.json"), b"{}")
            })
            .unwrap();
        }
        std::fs::create_dir_all(run.checkpoints().join(".tmp-step-6")).unwrap();
        // A rank killed while it sent its optimizer state leaves the state it staged.
        std::fs::write(run.checkpoints().join(".tmp-rank-1-optimizer.bin"), b"moments").unwrap();
        let resumed = RunDir::resuming(dir.path());
        resumed.prepare_checkpoints().unwrap();
        let names = || -> Vec<String> {
            let mut names: Vec<String> = std::fs::read_dir(run.checkpoints())
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            names.sort();
            names
        };
        assert_eq!(names(), ["step-2", "step-4"]);
        // A child run started afresh (its parent owns the folder) drops an earlier attempt's.
        run.prepare_checkpoints().unwrap();
        assert_eq!(names(), Vec::<String>::new());
    }
}
