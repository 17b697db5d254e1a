//! The loop every method trains in.
//!
//! A method — an offline objective ([`super::Trainer`]), PPO's sample-score-update step,
//! online DPO's sample-judge-update step — implements [`Method`]: what one step does to the
//! model and what it measures. [`run_loop`] owns everything around it, once for all of them:
//! resuming from the newest intact checkpoint (model, master weights, optimizer state), the
//! AdamW optimizer with clipping and its sharded (ZeRO-1) state ([`Optimizer`]), the step-0
//! and periodic evaluations, `train.keep_best`, `metrics.jsonl` and TensorBoard rows, the
//! progress bar, `--stop-after`, the data-parallel weight check, checkpoints written
//! atomically, the final save and the plot.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Device;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use aligner_parallel::overlap::{Overlap, OverlapStats};
use aligner_parallel::{Communicator, ReduceOp};

use super::config::Sharding;
use super::stream::SaveParts;
use super::{
    BestMode, MetricsLog, TrainSection, adamw, grads, load_optimizer, master, metrics, plot_metrics,
    save_optimizer,
};
use crate::error::{CoreError, Result};
use crate::run::{RunDir, progress_bar};
use crate::store::ModelStore;

/// Where a method's checkpoint keeps its parts (`checkpoints/step-N/...`).
#[derive(Debug, Clone, Copy)]
pub struct CheckpointLayout {
    /// The file written last, marking the checkpoint complete ([`LoopState`]).
    pub state: &'static str,
    /// The model's folder inside the checkpoint ("" = the checkpoint folder itself).
    pub model: &'static str,
    /// The optimizer state's file (one process or an unsharded state).
    pub optimizer: &'static str,
}

impl CheckpointLayout {
    /// An offline trainer's: the model folder is the checkpoint, `optimizer.bin`,
    /// `trainer_state.json`.
    pub const TRAINER: Self = Self {
        state: super::TRAINER_STATE,
        model: "",
        optimizer: "optimizer.bin",
    };
}

/// The loop's own settings (most from `[train]`).
#[derive(Debug, Clone)]
pub struct LoopSettings {
    /// Steps of the whole run.
    pub steps: usize,
    /// Stored with each checkpoint (the seed a method's randomness derives from).
    pub seed: u64,
    pub weight_decay: f64,
    /// AdamW's ε (`train.adam_epsilon`).
    pub adam_epsilon: f64,
    /// Global gradient-norm clipping (0 = none).
    pub max_grad_norm: f64,
    /// ZeRO-1: each rank keeps the optimizer state of its share of the parameters.
    /// What each data-parallel rank keeps only its share of (`train.sharding`).
    pub sharding: Sharding,
    /// `full` sharding: keep each layer's gathered weight for its backward (`train.keep_gathered`).
    pub keep_gathered: bool,
    /// Data parallel: gradient buckets of this many values summed during the backward
    /// (`train.bucket_mb`; 0 = after it).
    pub bucket_elements: usize,
    /// A metrics row every this many steps (evaluation steps and the last step always).
    pub log_every: usize,
    /// Evaluate every this many steps (0 = at the start and the end only).
    pub eval_every: usize,
    /// A checkpoint every this many steps (0 = none).
    pub save_every: usize,
    /// Data parallel: compare every rank's weights every this many steps (and at the end).
    pub sync_check_every: usize,
    pub tensorboard: bool,
    /// Keep the model of the best value of this evaluation metric as `best/` and `final/`.
    pub keep_best: Option<String>,
    pub keep_best_mode: BestMode,
    pub layout: CheckpointLayout,
    /// The progress bar's label ("step", "ppo step", ...).
    pub label: &'static str,
    /// What [`run_loop`] hands back when the ranks hold the model in parts; a caller that
    /// needs only `final/` leaves it at [`ReturnedModel::Nothing`].
    pub returns_model: ReturnedModel,
}

/// The trained model [`run_loop`] hands back when the ranks hold it in parts (fully sharded,
/// or split over tensor groups); a model held whole comes back as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReturnedModel {
    /// None: the caller reads `final/`.
    #[default]
    Nothing,
    /// Gathered whole on every rank (a collective).
    Whole,
    /// A tensor group's blocks as each rank holds them, their splits still registered, for a
    /// caller that trains or generates with them again (SPIN's next iteration); fully sharded
    /// parameters are gathered whole.
    AsHeld,
}

impl LoopSettings {
    /// A loop of `steps` steps with `[train]`'s settings (every method's loop section), in
    /// the trainer's checkpoint layout; a method with a layout of its own replaces `layout`.
    pub fn from_train(config: &TrainSection, steps: usize) -> Self {
        Self {
            steps,
            seed: config.seed,
            weight_decay: config.weight_decay,
            adam_epsilon: config.adam_epsilon,
            max_grad_norm: config.max_grad_norm,
            sharding: config.sharding,
            keep_gathered: config.keep_gathered,
            bucket_elements: super::config::bucket_elements(config.bucket_mb),
            log_every: config.log_every,
            eval_every: config.eval_every,
            save_every: config.save_every,
            sync_check_every: config.sync_check_every,
            tensorboard: config.tensorboard,
            keep_best: config.keep_best.clone(),
            keep_best_mode: config.keep_best_mode,
            layout: CheckpointLayout::TRAINER,
            label: "step",
            returns_model: ReturnedModel::Nothing,
        }
    }
}

/// AdamW with decoupled weight decay and global-norm clipping, and in a data-parallel run the
/// gradients' synchronisation: summed over the ranks (all-reduced) and, with
/// `train.sharding`, ZeRO stage 1 (each rank keeps the moments of, and updates, its share of
/// the parameters and broadcasts them) or stage 2 (the gradients are reduce-scattered, so each
/// rank receives only its share's).
pub struct Optimizer<'a> {
    adam: ModuleOptimizer,
    max_grad_norm: f64,
    sharding: Sharding,
    /// Ranks the state is sharded over (0 = not sharded).
    shards: usize,
    /// Each parameter's owning rank, found at the first sharded step.
    owners: Option<Vec<usize>>,
    comm: &'a dyn Communicator,
    /// The tensor group the parameters are split over (`parallel.tensor`), if any.
    tensor: Option<std::sync::Arc<dyn Communicator>>,
    /// Gradient buckets of this many values summed during the backward (0 = after it).
    bucket_elements: usize,
    /// The overlap of those sums, made at the first pass that uses it.
    overlap: Option<Overlap>,
}

impl<'a> Optimizer<'a> {
    /// A fresh optimizer; `sharding` takes effect over more than one rank.
    pub fn new(
        weight_decay: f64,
        adam_epsilon: f64,
        max_grad_norm: f64,
        sharding: Sharding,
        comm: &'a dyn Communicator,
    ) -> Self {
        let world = comm.world_size();
        Self {
            adam: adamw(weight_decay, adam_epsilon),
            max_grad_norm,
            sharding,
            shards: if sharding.shards_optimizer() && world > 1 {
                world
            } else {
                0
            },
            owners: None,
            comm,
            tensor: None,
            bucket_elements: 0,
            overlap: None,
        }
    }

    /// Data parallel: sums the gradients in buckets of about `bucket_elements` values while
    /// the backward pass goes on, each as soon as its gradients are complete
    /// (`train.bucket_mb`; 0 = all of them after the backward). It takes effect over more
    /// than one rank with `train.sharding` "none" or "optimizer", outside tensor groups, for
    /// the passes a method announces with [`Optimizer::begin_pass`].
    pub fn with_overlap(mut self, bucket_elements: usize) -> Self {
        self.bucket_elements = bucket_elements;
        self
    }

    /// Whether the gradient sums overlap the backward passes (see [`Optimizer::with_overlap`]).
    pub fn overlaps(&self) -> bool {
        self.bucket_elements > 0
            && self.comm.world_size() > 1
            && self.tensor.is_none()
            && matches!(self.sharding, Sharding::None | Sharding::Optimizer)
    }

    /// Announces a forward and backward pass of a step over `model` (the step's `last`, or
    /// an earlier micro-batch's): with overlap its gradients go to the buckets, which the
    /// last pass sends as they complete. Every rank calls it before each pass, an idle one
    /// too (the first call is a collective).
    pub fn begin_pass<M: Module>(&mut self, model: &M, last: bool) -> Result<()> {
        if !self.overlaps() {
            return Ok(());
        }
        if self.overlap.is_none() {
            self.overlap = Some(Overlap::new(self.comm, self.bucket_elements)?);
        }
        let params = grads::trainable_params(model);
        if let Some(overlap) = self.overlap.as_mut() {
            overlap.arm(&params, last);
        }
        Ok(())
    }

    /// The overlapped sums' figures so far (`None` without overlap).
    pub fn overlap_stats(&self) -> Option<OverlapStats> {
        self.overlap.as_ref().map(Overlap::stats)
    }

    /// Sums `grads` over the ranks: what the armed passes' buckets summed, and the rest now
    /// (all of it without overlap).
    fn sum_gradients<M: Module>(&mut self, model: &M, grads: &mut GradientsParams) -> Result<()> {
        match self.overlap.as_mut().filter(|o| o.armed()) {
            Some(overlap) => {
                let unhooked = grads::take_gradients(model, grads);
                let summed = overlap.finish(self.comm, unhooked)?;
                grads::put_gradients(model, grads, summed);
            }
            None => grads::all_reduce_gradients(model, grads, 1.0, self.comm)?,
        }
        Ok(())
    }

    /// The optimizer of a model whose parameters are split over `group` (tensor parallel): the
    /// global norm counts each split parameter's blocks over the group, and a checkpoint's
    /// state is the whole model's (joined from the group's ranks, and cut again on load).
    pub fn with_tensor_group(mut self, group: Option<std::sync::Arc<dyn Communicator>>) -> Self {
        self.tensor = group.filter(|g| g.world_size() > 1);
        self
    }

    /// Ranks the state is sharded over (0 = one whole state).
    pub fn shards(&self) -> usize {
        self.shards
    }

    /// Whether the parameters are split over a tensor group (`parallel.tensor`).
    pub fn splits(&self) -> bool {
        self.tensor.is_some()
    }

    /// Whether the parameters themselves are sharded (`train.sharding = "full"` over more
    /// than one rank): the state holds each rank's rows of every parameter.
    pub fn full(&self) -> bool {
        self.shards > 0 && self.sharding == Sharding::Full
    }

    /// Sums `grads`, this rank's gradients, over the ranks (a collective: every rank calls
    /// it), clips them to the global norm (`max_grad_norm`, 0 = no clipping) and takes one
    /// step at `lr`; the updated model and the norm before clipping out.
    pub fn step<M: Module>(&mut self, lr: f64, model: M, mut grads: GradientsParams) -> Result<(M, f64)> {
        if self.shards == 0 {
            self.sum_gradients(&model, &mut grads)?;
            let norm = self.clip_over_ranks(&model, &mut grads, false)?;
            return Ok((self.adam.step(lr, model, grads), norm));
        }
        if self.sharding == Sharding::Full {
            // The backward reduce-scattered each gradient: `grads` are this rank's rows.
            let norm = self.clip_over_ranks(&model, &mut grads, true)?;
            return Ok((self.adam.step(lr, model, grads), norm));
        }
        if self.sharding == Sharding::Optimizer {
            self.sum_gradients(&model, &mut grads)?;
        }
        let owners = self.owners_of(&model)?;
        let rank = self.comm.rank();
        let norm = if self.sharding == Sharding::Gradients {
            grads::reduce_scatter_gradients(&model, &mut grads, &owners, self.comm)?;
            self.clip_over_ranks(&model, &mut grads, true)?
        } else {
            let norm = self.clip_over_ranks(&model, &mut grads, false)?;
            grads::keep_owned_gradients(&model, &mut grads, &owners, rank);
            norm
        };
        let updated = self.adam.step(lr, model, grads);
        Ok((
            grads::broadcast_owned_parameters(updated, &owners, self.comm)?,
            norm,
        ))
    }

    /// Each trainable parameter's owning data rank, found at the first sharded step. In
    /// tensor groups every rank takes its group's rank 0's (blocks of uneven sizes would
    /// balance otherwise), so each parameter's blocks have one owner across the group and a
    /// checkpoint joins them.
    fn owners_of<M: Module>(&mut self, model: &M) -> Result<Vec<usize>> {
        if let Some(owners) = &self.owners {
            return Ok(owners.clone());
        }
        let mut owners = grads::optimizer_owners(model, self.shards);
        if let Some(group) = &self.tensor {
            owners = crate::parallel::broadcast_from_root(group.as_ref(), &owners)?;
        }
        self.owners = Some(owners.clone());
        Ok(owners)
    }

    /// Clips `grads` to the global norm (`max_grad_norm`, 0 = no clipping) of the whole
    /// model's gradient (a collective); the norm before clipping out. `shares`: each data rank
    /// holds its own share of the gradients (sharded), whose squares are summed over the
    /// ranks. In a tensor group a split parameter's blocks are parts of one gradient, summed
    /// over the group, while a whole one is the same on every rank of it and counts once.
    fn clip_over_ranks<M: Module>(
        &self,
        model: &M,
        grads: &mut GradientsParams,
        shares: bool,
    ) -> Result<f64> {
        let Some(group) = &self.tensor else {
            return match shares {
                true => clip_shares(self.comm, model, grads, self.max_grad_norm),
                false => Ok(grads::clip_grad_norm(model, grads, self.max_grad_norm)),
            };
        };
        let split = |id: u64| super::tensor::is_split(id);
        let whole = |id: u64| !super::tensor::is_split(id);
        let mut squares = [
            grads::squared_grad_norm_of(model, grads, Some(&split)),
            grads::squared_grad_norm_of(model, grads, Some(&whole)),
        ];
        if shares {
            self.comm.all_reduce_f64(&mut squares, ReduceOp::Sum)?;
        }
        let mut blocks = [squares[0]];
        group.all_reduce_f64(&mut blocks, ReduceOp::Sum)?;
        let norm = ((blocks[0] + squares[1]) as f32).sqrt() as f64;
        grads::scale_to_norm(model, grads, norm, self.max_grad_norm);
        Ok(norm)
    }

    /// The file this rank's state is saved in, by `layout`.
    fn file(&self, layout: &CheckpointLayout) -> String {
        match self.shards {
            0 => layout.optimizer.to_string(),
            _ => optimizer_shard(self.comm.rank()),
        }
    }

    /// Writes the state into checkpoint folder `tmp` (the writer, rank 0): one process's whole
    /// state; a tensor group's, each split moment gathered from the group as the file reaches
    /// it; a sharded state's part of every rank, the others' moved in from where
    /// [`Optimizer::stage`] put them in `checkpoints`.
    fn save(&self, tmp: &Path, layout: &CheckpointLayout, checkpoints: &Path) -> Result<()> {
        if self.shards == 0 {
            return self.write_state(&tmp.join(layout.optimizer));
        }
        self.write_state(&tmp.join(optimizer_shard(0)))?;
        for rank in 1..self.shards {
            let (staged, to) = (staged_state(checkpoints, rank), tmp.join(optimizer_shard(rank)));
            std::fs::rename(&staged, &to).map_err(|e| CoreError::cannot_write(&to, e))?;
        }
        Ok(())
    }

    /// Writes this rank's state to `path`: as AdamW holds it, or in a tensor group with each
    /// split moment joined from the group's blocks as the file reaches it (the group's other
    /// ranks send theirs: [`super::tensor::send_optimizer_blocks`]).
    fn write_state(&self, path: &Path) -> Result<()> {
        match self.tensor {
            Some(_) => super::tensor::write_gathered_optimizer_state(&self.adam, path),
            None => save_optimizer(&self.adam, path),
        }
    }

    /// What every rank but the writer does for a checkpoint's optimizer state (a collective;
    /// nothing for one process). Sharded, each data rank streams its part to a staged file in
    /// `checkpoints` and all wait until every part is written; the writer moves them into the
    /// checkpoint, so no rank ever holds another's part. In tensor groups a part is the
    /// whole moments of what the data rank owns: its group's rank 0 writes it while the
    /// group's other ranks send it their blocks, a moment at a time (unsharded, only the
    /// writer's group: the writer writes the whole state in [`Optimizer::save`]).
    fn stage(&self, checkpoints: &Path) -> Result<()> {
        let data_rank = self.comm.rank();
        let group_rank = self.tensor.as_ref().map(|group| group.rank());
        // Unsharded, only the writer's tensor group takes part.
        if self.shards == 0 && (group_rank.is_none() || data_rank != 0) {
            return Ok(());
        }
        std::fs::create_dir_all(checkpoints).map_err(|e| CoreError::cannot_write(checkpoints, e))?;
        match group_rank {
            // To its group's rank 0 (the writer, world rank 0, for the data rank 0).
            Some(rank) if rank != 0 => {
                let scratch = checkpoints.join(format!(".tmp-rank-{data_rank}-{rank}-blocks.bin"));
                super::tensor::send_optimizer_blocks(&self.adam, &scratch)?;
            }
            _ if data_rank != 0 => self.write_state(&staged_state(checkpoints, data_rank))?,
            _ => {}
        }
        match self.shards {
            0 => Ok(()),
            _ => Ok(self.comm.barrier()?),
        }
    }

    /// Loads the state a checkpoint holds for this rank. A state saved over `saved_shards`
    /// ranks (0 = one file) that this run shards otherwise is re-sharded: every part is read
    /// and this rank keeps the moments of the parameters it owns now (all of them unsharded).
    fn load<M: Module>(
        mut self,
        dir: &Path,
        layout: &CheckpointLayout,
        saved: &LoopState,
        model: &M,
    ) -> Result<Self> {
        let saved_shards = saved.optimizer_shards;
        let split = self.tensor.is_some();
        if split && self.shards == 0 && saved_shards == 0 && !saved.optimizer_rows {
            // A whole state (an unsharded tensor-parallel checkpoint's, or one process's):
            // this rank's blocks of it.
            let path = dir.join(layout.optimizer);
            let bytes = std::fs::read(&path).map_err(|e| CoreError::io(&path, e))?;
            let own = super::tensor::split_optimizer_state(bytes)?;
            self.adam = self
                .adam
                .from_bytes(burn::tensor::Bytes::from_bytes_vec(own))
                .map_err(|e| CoreError::Invalid(format!("{}: optimizer state: {e:?}", path.display())))?;
            return Ok(self);
        }
        if !split && saved_shards == self.shards && saved.optimizer_rows == self.full() {
            let file = self.file(layout);
            self.adam = load_optimizer(self.adam, &dir.join(file))?;
            return Ok(self);
        }
        let files: Vec<PathBuf> = match saved_shards {
            0 => vec![dir.join(layout.optimizer)],
            n => (0..n).map(|rank| dir.join(optimizer_shard(rank))).collect(),
        };
        // A fully sharded state's parts are rows of each moment: joined, they are whole.
        let rows = match self.full() {
            true => Some((self.comm.rank(), self.shards)),
            false => None,
        };
        let owned: Option<HashSet<u64>> = match self.shards > 0 && !self.full() {
            true => {
                let owners = self.owners_of(model)?;
                let rank = self.comm.rank();
                let ids = grads::trainable_ids(model).into_iter().zip(owners);
                Some(
                    ids.filter(|(_, owner)| *owner == rank)
                        .map(|(id, _)| id)
                        .collect(),
                )
            }
            false => None,
        };
        let mut merged = merge_optimizer_states(&files, saved.optimizer_rows, rows, |id| {
            owned.as_ref().is_none_or(|o| o.contains(&id))
        })?;
        if split {
            // The state merged holds whole moments: this rank's blocks of them.
            merged = super::tensor::split_optimizer_state(merged)?;
        }
        self.adam = self
            .adam
            .from_bytes(burn::tensor::Bytes::from_bytes_vec(merged))
            .map_err(|e| CoreError::Invalid(format!("{}: optimizer state: {e:?}", dir.display())))?;
        tracing::info!(
            from = saved_shards,
            to = self.shards,
            "re-sharded the optimizer state (0 = one file)"
        );
        Ok(self)
    }
}

/// Clips `grads`, this rank's share of the summed gradients, to the global norm `max_norm`
/// (0 = no clipping): the square root of the ranks' summed squares (a collective); the norm
/// before clipping out.
fn clip_shares<M: Module>(
    comm: &dyn Communicator,
    model: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
) -> Result<f64> {
    let mut squares = [grads::squared_grad_norm(model, grads)];
    comm.all_reduce_f64(&mut squares, ReduceOp::Sum)?;
    let norm = squares[0].sqrt();
    grads::scale_to_norm(model, grads, norm, max_norm);
    Ok(norm)
}

/// One optimizer state out of AdamW states saved by [`save_optimizer`] or as shards (burnpack
/// files whose tensors carry their parameter id, and whose scalars and metadata are keyed
/// `"{id}"` / `"{id}.{name}"`): the parameters `keep` accepts, from whichever file has them.
///
/// `joined`: the files are a fully sharded state's parts, in rank order, each holding its
/// rank's rows of every tensor: a tensor's parts are joined along the first axis. `rows`:
/// keep only rank `r`'s rows of each tensor of `n` ranks (the state of a fully sharded run).
fn merge_optimizer_states(
    files: &[PathBuf],
    joined: bool,
    rows: Option<(usize, usize)>,
    keep: impl Fn(u64) -> bool,
) -> Result<Vec<u8>> {
    let bad = |path: &Path, e: burn_pack::Error| {
        CoreError::Invalid(format!("{}: optimizer state: {e:?}", path.display()))
    };
    // A fully sharded state's shards carry their own ids (`shard_id`): the whole
    // parameter's id is what `keep` judges, and what is written unless the state is for a
    // fully sharded run again.
    let whole = |id: u64| {
        if joined {
            aligner_parallel::shard::whole_id(id)
        } else {
            id
        }
    };
    let written = |id: u64| match rows {
        Some(_) => aligner_parallel::shard::shard_id(id),
        None => id,
    };
    let id_of = |key: &str| {
        key.split('.')
            .next()
            .and_then(|id| id.parse::<u64>().ok())
            .map(whole)
    };
    // `"{id}"` / `"{id}.{name}"` keys with the id as written.
    let renamed = |key: &str| match (id_of(key), key.split_once('.')) {
        (Some(id), Some((_, rest))) => format!("{}.{rest}", written(id)),
        (Some(id), None) => written(id).to_string(),
        (None, _) => key.to_string(),
    };
    // (name, dtype, shape, parameter id, bytes) of each tensor kept.
    type Part = (String, burn::tensor::DType, Vec<usize>, Option<u64>, Vec<u8>);
    let mut tensors: Vec<Part> = Vec::new();
    let mut scalars = Vec::new();
    let mut metadata = Vec::new();
    for path in files {
        let reader = burn_pack::Reader::from_file(path).map_err(|e| bad(path, e))?;
        let kept = |key: &String| id_of(key).is_some_and(&keep);
        scalars.extend(
            reader
                .scalars()
                .iter()
                .filter(|(k, _)| kept(k))
                .map(|(k, v)| (renamed(k), *v)),
        );
        metadata.extend(
            reader
                .metadata()
                .iter()
                .filter(|(k, _)| kept(k))
                .map(|(k, v)| (renamed(k), v.clone())),
        );
        for tensor in reader.into_tensors().map_err(|e| bad(path, e))? {
            let (name, dtype, shape, id, bytes) = tensor.into_parts().map_err(|e| bad(path, e))?;
            let id = id.map(whole);
            if !id.is_some_and(&keep) {
                continue;
            }
            let (name, id) = (renamed(&name), id.map(written));
            let earlier = tensors.iter().position(|t: &Part| t.0 == name && t.3 == id);
            match earlier {
                Some(at) if joined => {
                    let part = &mut tensors[at];
                    part.2[0] += shape[0];
                    part.4.extend_from_slice(&bytes);
                }
                _ => tensors.push((name, dtype, shape.to_vec(), id, bytes.to_vec())),
            }
        }
    }
    let tensors: Vec<burn_pack::Tensor> = tensors
        .into_iter()
        .map(|(name, dtype, mut shape, id, mut bytes)| {
            if let Some((rank, world)) = rows {
                let row_bytes = bytes.len() / shape[0].max(1);
                let own = aligner_parallel::shard_range(shape[0], rank, world);
                bytes = bytes[own.start * row_bytes..own.end * row_bytes].to_vec();
                shape[0] = own.len();
            }
            burn_pack::Tensor::new(name, dtype, shape, id, burn::tensor::Bytes::from_bytes_vec(bytes))
        })
        .collect();
    let mut writer = burn_pack::Writer::new(tensors);
    for (key, value) in &scalars {
        writer = writer.with_scalar(key, *value);
    }
    for (key, value) in &metadata {
        writer = writer.with_metadata(key, value);
    }
    let bytes = writer
        .into_bytes()
        .map_err(|e| CoreError::Invalid(format!("merging optimizer states: {e:?}")))?;
    Ok(bytes.to_vec())
}

/// Where rank `rank` stages its part of a checkpoint's optimizer state: in the run's
/// `checkpoints` folder, whose next run clears a killed save's (`.tmp-` names).
fn staged_state(checkpoints: &Path, rank: usize) -> PathBuf {
    checkpoints.join(format!(".tmp-rank-{rank}-optimizer.bin"))
}

/// The file rank `rank`'s share of a sharded optimiser state is saved in.
pub fn optimizer_shard(rank: usize) -> String {
    format!("optimizer-rank-{rank}.bin")
}

/// What one step did: the updated model, its metrics and the progress bar's message.
pub struct Stepped<M> {
    pub model: M,
    /// The step's metrics (the loop adds `step` and, at evaluations, the evaluation's).
    pub row: Map<String, Value>,
    pub message: String,
}

/// One training method, as the shared loop runs it.
pub trait Method<M: Module> {
    /// The method crate's error (the loop's own errors convert into it).
    type Error: From<CoreError>;

    /// Called once the model is in place, before the step-0 evaluation: set up what needs the
    /// trained weights (generation engines); `resumed` is the checkpoint a resumed run loaded,
    /// for the method's own parts of it.
    fn begin(&mut self, _model: &M, _resumed: Option<&Path>) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Whether [`Method::step`] trains a fully sharded model (`train.sharding = "full"`): its
    /// forward and backward passes must be the same on every rank, since each sharded
    /// parameter's use is a collective, and it must read parameters only through the model.
    fn shards_fully(&self) -> bool {
        false
    }

    /// Whether [`Method::step`] trains a model split over a tensor group (`parallel.tensor`):
    /// its forward and backward passes must be the same on the group's ranks, which see the
    /// same examples, and it must read parameters only through the model.
    fn splits_tensors(&self) -> bool {
        false
    }

    /// Whether [`Method::evaluate`] can run on the model as the ranks hold it when they hold it
    /// in parts: split over a tensor group (each group's ranks evaluating the same examples
    /// together) or fully sharded (every rank running the same forward passes), instead of on
    /// the model gathered whole on every rank.
    fn evaluates_in_parts(&self) -> bool {
        false
    }

    /// Step `step` (0-based): the model in, updated through `optim`, out with its metrics.
    fn step(&mut self, step: usize, model: M, optim: &mut Optimizer<'_>) -> Result<Stepped<M>, Self::Error>;

    /// Whether [`Method::evaluate`] measures anything.
    fn validates(&self) -> bool;

    /// The evaluation metrics of `model` (named as logged: `eval_...`).
    fn evaluate(&mut self, model: &M) -> Result<Map<String, Value>, Self::Error>;

    /// Writes a checkpoint into its temporary folder `tmp`: `write_model` writes the model,
    /// its optimizer state and nothing else; a method with parts of its own (PPO's critic)
    /// writes them around it.
    fn checkpoint(
        &self,
        _tmp: &Path,
        write_model: &mut dyn FnMut() -> Result<()>,
    ) -> Result<(), Self::Error> {
        Ok(write_model()?)
    }

    /// Writes the method's own parts of the finished run (rank 0, after `final/`).
    fn finish(&self, _run: &RunDir) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Metrics drawn in the run's `metrics.svg`.
    fn plot_keys(&self) -> Vec<String>;
}

/// Position of a run, stored with each checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoopState {
    /// Steps completed.
    pub step: usize,
    #[serde(default)]
    pub total_steps: usize,
    /// The seed the run's randomness derives from.
    #[serde(default)]
    pub seed: u64,
    /// Ranks the optimiser state was sharded over (`optimizer-rank-R.bin`); 0 = one file.
    #[serde(default)]
    pub optimizer_shards: usize,
    /// Whether each shard holds its rank's rows of every parameter's moments (a fully
    /// sharded run) rather than whole moments of the parameters it owns.
    #[serde(default)]
    pub optimizer_rows: bool,
}

/// The end of a run.
#[derive(Debug, Clone)]
pub struct RunSummary {
    /// Steps done (fewer than the run's when it stopped early: `--stop-after`).
    pub steps: usize,
    pub final_dir: std::path::PathBuf,
    /// The step-0 evaluation (read back from `metrics.jsonl` by a resumed run).
    pub initial_eval: Option<Map<String, Value>>,
    /// The last evaluation (of the kept step with `train.keep_best`); empty when the run
    /// stopped early.
    pub final_eval: Map<String, Value>,
}

/// The folder `train.keep_best` keeps the best model in, and the file naming its step.
pub const BEST_DIR: &str = "best";
const BEST_FILE: &str = "best.json";
/// The run-folder file saying which step `final/` holds.
pub const FINAL_STEP: &str = "final_step.json";

/// The step of the model kept by `train.keep_best`, with its `metric` and `value`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FinalStep {
    pub step: usize,
    pub metric: String,
    pub value: f64,
}

/// Refuses, naming the keys, a layout not built yet: fully sharded parameters over
/// `data_ranks` > 1 beside tensor groups (`split`).
pub fn check_layout(sharding: Sharding, data_ranks: usize, split: bool) -> Result<()> {
    if split && sharding == Sharding::Full && data_ranks > 1 {
        return Err(CoreError::Invalid(
            "parallel.tensor with train.sharding = \"full\" is not built yet: shard the tensor \
             groups' blocks with \"gradients\" (or \"optimizer\")"
                .into(),
        ));
    }
    Ok(())
}

/// Trains `model` with `method` for `settings.steps` steps in `run` (or, when the run is
/// resumed, continues from its newest intact checkpoint) on `train_device`; the trained model
/// (see [`LoopSettings::returns_model`]) and the summary out. `final/` holds the trained model (the best one with `keep_best`),
/// saved through `store`.
pub fn run_loop<M: Module + 'static, T: Method<M>>(
    method: &mut T,
    model: M,
    store: &dyn ModelStore<M>,
    settings: &LoopSettings,
    run: &RunDir,
    train_device: &Device,
) -> Result<(Option<M>, RunSummary), T::Error> {
    let total = settings.steps;
    let layout = &settings.layout;
    let comm = run.comm();
    let world = comm.world_size();
    let tensor = run.tensor_group();
    if tensor.is_some() {
        if !method.splits_tensors() {
            return Err(CoreError::Invalid(format!(
                "parallel.tensor is not available for this method's {} loop yet; use parallel.tensor = 1",
                settings.label
            ))
            .into());
        }
        check_layout(settings.sharding, world, true)?;
    }
    let mut optim = Optimizer::new(
        settings.weight_decay,
        settings.adam_epsilon,
        settings.max_grad_norm,
        settings.sharding,
        comm,
    )
    .with_tensor_group(tensor.clone())
    .with_overlap(settings.bucket_elements);
    run.prepare_checkpoints()?;
    let resume = run.resume_point(layout.state)?;
    // A tensor-parallel state is cut to the model's blocks, so it loads once they exist.
    let mut state_to_load = None;
    let (mut model, start) = match &resume {
        Some((step, dir)) => {
            let model = master::load_with_masters(store, &dir.join(layout.model), train_device)?;
            let model = super::config::to_train_device(model, train_device);
            let state: LoopState = crate::checkpoint::read_json(&dir.join(layout.state))?;
            match tensor {
                Some(_) => state_to_load = Some((dir.clone(), state)),
                None => optim = optim.load(dir, layout, &state, &model)?,
            }
            tracing::info!(step, dir = %dir.display(), "resuming");
            (model, *step)
        }
        None => (super::config::to_train_device(model, train_device), 0),
    };
    // The method's own parts load first: a resume that fails there (a critic that does not
    // answer) leaves the log as it was.
    let full = optim.full();
    if full && !method.shards_fully() {
        return Err(CoreError::Invalid(format!(
            "train.sharding = \"full\" is not available for this method's {} loop yet; use \"gradients\"",
            settings.label
        ))
        .into());
    }
    method.begin(&model, resume.as_ref().map(|(_, dir)| dir.as_path()))?;
    // Sharded after `begin`, which may read the whole weights (PPO's engines).
    if full {
        model = super::full::shard_parameters(model, run.comm_handle())?;
        aligner_parallel::shard::keep_gathered(settings.keep_gathered);
    }
    if let Some(group) = &tensor {
        model = super::tensor::split_parameters(model, group.clone())?;
        if let Some((dir, state)) = state_to_load.take() {
            optim = optim.load(&dir, layout, &state, &model)?;
        }
    }
    let split = tensor.is_some();
    // How a save reaches the writer: the parameters held in parts (fully sharded rows, a
    // tensor group's blocks) are gathered to it one at a time as its files reach them.
    let parts = SaveParts::of(run, full, split);
    let reads_parameters = store.reads_parameters();
    // What evaluations see: the model as the ranks hold it where the method can evaluate it
    // in parts (no whole copy), else the model gathered whole on every rank.
    let in_parts = (split || full) && method.evaluates_in_parts();
    // With how its ranks hold it, which is how `best/` is saved from it.
    fn seen_by_evaluation<'m, M: Module>(
        model: &'m M,
        parts: &'m SaveParts,
        in_parts: bool,
        (full, split): (bool, bool),
    ) -> (std::borrow::Cow<'m, M>, &'m SaveParts) {
        match in_parts {
            true => (std::borrow::Cow::Borrowed(model), parts),
            false => (whole_of(model, full, split), &SaveParts::Whole),
        }
    }
    let log =
        MetricsLog::for_run_with_tensorboard(run, run.is_resumed().then_some(start), settings.tensorboard)?;
    let initial_eval = if start == 0 && method.validates() {
        let (seen, seen_as) = seen_by_evaluation(&model, &parts, in_parts, (full, split));
        let eval = method.evaluate(&seen)?;
        let mut row = Map::new();
        row.insert("step".into(), 0.into());
        row.extend(eval.clone());
        log.write(&row)?;
        keep_if_best(settings, run, store, (&seen, seen_as), 0, &eval)?;
        // As metrics.jsonl holds it: text summaries go to TensorBoard only.
        Some(
            eval.into_iter()
                .filter(|(k, _)| !k.starts_with(metrics::TEXT_PREFIX))
                .collect(),
        )
    } else {
        // A resumed run reads its step-0 evaluation back from the log it kept.
        let logged = eval_of(log.rows()?.iter().find(|r| step_of(r) == Some(0)));
        Some(run.agree(&logged)?).filter(|eval| !eval.is_empty())
    };

    let bar = progress_bar(
        total as u64,
        &format!(
            "{} {{pos}}/{{len}} {{bar:30}} {{msg}} [{{elapsed}} < {{eta}}]",
            settings.label
        ),
    );
    bar.set_position(start as u64);
    for step in start..total {
        if run.stops_at(step) {
            bar.abandon();
            let model = returned_model(model, settings, full, split);
            return Ok((model, summary(run, step, initial_eval, Map::new())));
        }
        let stepped = match method.step(step, model, &mut optim) {
            Ok(stepped) => stepped,
            Err(e) => {
                bar.abandon();
                return Err(e);
            }
        };
        model = stepped.model;
        let done = step + 1;
        // A fully sharded model's ranks hold different rows: nothing to compare.
        if world > 1
            && !full
            && (done == total
                || (settings.sync_check_every > 0 && done.is_multiple_of(settings.sync_check_every)))
        {
            check_in_sync(run, &model, done)?;
        }
        bar.set_position(done as u64);
        bar.set_message(stepped.message);
        let eval_now = method.validates()
            && (done == total || (settings.eval_every > 0 && done.is_multiple_of(settings.eval_every)));
        if done.is_multiple_of(settings.log_every.max(1)) || eval_now || done == total {
            let mut row = stepped.row;
            row.insert("step".into(), done.into());
            // Before the evaluation, whose activations and samples are not the step's.
            row.extend(super::metrics::device_memory(train_device));
            if eval_now {
                let (seen, seen_as) = seen_by_evaluation(&model, &parts, in_parts, (full, split));
                let eval = method.evaluate(&seen)?;
                keep_if_best(settings, run, store, (&seen, seen_as), done, &eval)?;
                row.extend(eval);
            }
            log.write(&row)?;
        }
        if settings.save_every > 0 && done.is_multiple_of(settings.save_every) && done < total {
            let state = LoopState {
                step: done,
                total_steps: total,
                seed: settings.seed,
                optimizer_shards: optim.shards(),
                optimizer_rows: full,
            };
            // The model first, then the optimizer: in tensor groups its blocks go to the
            // writer while it writes the file, after the model's.
            let checkpoints = run.checkpoints();
            if !parts.writes(run) {
                parts.help_save(&model, reads_parameters)?;
                optim.stage(&checkpoints)?;
            }
            run.save_checkpoint(done, |tmp| {
                method.checkpoint(tmp, &mut || {
                    // A half-precision model folder rounds the weights; training resumes from
                    // the master weights saved beside them.
                    let dir = tmp.join(layout.model);
                    parts.save_on_writer(&model, reads_parameters, |whole: &M| {
                        master::save_with_masters(store, &whole.valid(), &dir)
                    })?;
                    optim.stage(&checkpoints)?;
                    optim.save(tmp, layout, &checkpoints)
                })?;
                Ok::<_, T::Error>(crate::checkpoint::write_json(&tmp.join(layout.state), &state)?)
            })?;
        }
    }
    bar.finish_and_clear();
    if let Some(o) = optim.overlap_stats().filter(|o| o.steps > 0) {
        tracing::info!(
            "gradient sums: {} of {} buckets sent during the backward; {:.2} s of {:.2} s of \
             communication overlapped the computation",
            o.early_buckets,
            o.buckets,
            o.overlapped_seconds(),
            o.comm_seconds
        );
    }
    let reruns = crate::model::recompute::reruns();
    if reruns > 0 {
        tracing::info!(
            "train.activation_checkpointing: {reruns} decoder-layer passes rerun in the backward \
             from their kept inputs"
        );
    }
    // AdamW's moments are twice the weights: freed before the final save.
    drop(optim);
    let keys = method.plot_keys();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut final_eval = Map::new();
    // `final/` is the best evaluation's model with `keep_best` (copied from `best/`), else the
    // trained model, saved from the ranks' parts as a checkpoint's is.
    let kept = decide(run, || best(settings, run))?;
    if kept.is_none() && !parts.writes(run) {
        parts.help_save(&model, reads_parameters)?;
    }
    run.write_shared(|| {
        let rows = log.rows()?;
        final_eval = eval_of(rows.iter().rev().find(|r| r.keys().any(|k| k.starts_with("eval_"))));
        match &kept {
            Some(best) => {
                copy_folder(&run.join(BEST_DIR), &run.final_dir(), &[BEST_FILE])?;
                crate::checkpoint::write_json(&run.join(FINAL_STEP), best)?;
                tracing::info!(step = best.step, metric = %best.metric, value = best.value, "final/ is the best validation's model");
                final_eval = eval_of(rows.iter().find(|r| step_of(r) == Some(best.step)));
            }
            None => {
                parts.save_on_writer(&model, reads_parameters, |whole: &M| {
                    store.save(&whole.valid(), &run.final_dir())
                })?;
                crate::checkpoint::write_json(&run.join(FINAL_STEP), &serde_json::json!({ "step": total }))?;
            }
        }
        method.finish(run)?;
        Ok::<_, T::Error>(plot_metrics(&rows, &key_refs, &run.join("metrics.svg"))?)
    })?;
    let final_eval = run.agree(&final_eval)?;
    let model = returned_model(model, settings, full, split);
    Ok((model, summary(run, total, initial_eval, final_eval)))
}

/// What a run hands back: the trained model where the ranks hold it whole, or where the
/// caller asked for it (`settings.returns_model`: gathered whole on every rank, a collective,
/// or a tensor group's blocks as held, still registered); `None` for a model held in parts
/// that the caller does not need (it is in `final/`). The ranks' parts are forgotten unless
/// they are handed back.
fn returned_model<M: Module>(model: M, settings: &LoopSettings, full: bool, split: bool) -> Option<M> {
    if !full && split && settings.returns_model == ReturnedModel::AsHeld {
        return Some(model);
    }
    let returned = match (full || split, settings.returns_model) {
        (false, _) => Some(model),
        (true, ReturnedModel::Whole | ReturnedModel::AsHeld) => {
            Some(whole_of(&model, full, split).into_owned())
        }
        (true, ReturnedModel::Nothing) => None,
    };
    aligner_parallel::shard::clear();
    aligner_parallel::tensor::clear();
    returned
}

/// `f`'s outcome on the writer, shared by every rank (a decision that rests on the writer's
/// files); an error there is an error on every rank.
fn decide<T: Serialize + serde::de::DeserializeOwned>(
    run: &RunDir,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let outcome = match run.is_writer() {
        true => f(),
        false => Err(CoreError::Invalid("decided on the writer".into())),
    };
    let (shared, own_error) = match outcome {
        Ok(value) => (Ok(value), None),
        Err(e) => (Err(e.to_string()), Some(e).filter(|_| run.is_writer())),
    };
    match run.agree(&shared)? {
        Ok(value) => Ok(value),
        Err(why) => Err(own_error.unwrap_or(CoreError::Invalid(why))),
    }
}

/// Copies the files of folder `from` (and its subfolders) into `to` but those named in
/// `leave`, each through a temporary name and a rename.
fn copy_folder(from: &Path, to: &Path, leave: &[&str]) -> Result<()> {
    std::fs::create_dir_all(to).map_err(|e| CoreError::cannot_write(to, e))?;
    let entries = std::fs::read_dir(from).map_err(|e| CoreError::io(from, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| CoreError::io(from, e))?;
        let (source, target) = (entry.path(), to.join(entry.file_name()));
        if leave.iter().any(|name| entry.file_name() == *name) {
            continue;
        }
        if source.is_dir() {
            copy_folder(&source, &target, leave)?;
            continue;
        }
        let tmp = to.join(format!(".tmp-{}", entry.file_name().to_string_lossy()));
        std::fs::copy(&source, &tmp).map_err(|e| CoreError::cannot_write(&tmp, e))?;
        std::fs::rename(&tmp, &target).map_err(|e| CoreError::cannot_write(&target, e))?;
    }
    Ok(())
}

/// What an evaluation that cannot run on the parts sees: the whole model, gathered on every
/// rank when its parameters are `full`y sharded or `split` over a tensor group (a collective).
fn whole_of<M: Module>(model: &M, full: bool, split: bool) -> std::borrow::Cow<'_, M> {
    if full {
        return std::borrow::Cow::Owned(super::full::gather_parameters(model));
    }
    match split {
        true => std::borrow::Cow::Owned(super::tensor::gather_parameters(model)),
        false => std::borrow::Cow::Borrowed(model),
    }
}

fn summary(
    run: &RunDir,
    steps: usize,
    initial_eval: Option<Map<String, Value>>,
    final_eval: Map<String, Value>,
) -> RunSummary {
    RunSummary {
        steps,
        final_dir: run.final_dir(),
        initial_eval,
        final_eval,
    }
}

/// A metrics row's step (written as an integer, or as a float by older PPO runs).
fn step_of(row: &Map<String, Value>) -> Option<usize> {
    row.get("step").and_then(Value::as_f64).map(|s| s as usize)
}

/// The evaluation metrics (`eval_...`) of a row.
fn eval_of(row: Option<&Map<String, Value>>) -> Map<String, Value> {
    row.map(|r| {
        r.iter()
            .filter(|(k, _)| k.starts_with("eval_"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    })
    .unwrap_or_default()
}

/// The best evaluation kept so far (`best/best.json`), when `keep_best` is set.
fn best(settings: &LoopSettings, run: &RunDir) -> Result<Option<FinalStep>> {
    if settings.keep_best.is_none() {
        return Ok(None);
    }
    let path = run.join(BEST_DIR).join(BEST_FILE);
    match path.exists() {
        true => Ok(Some(crate::checkpoint::read_json(&path)?)),
        false => Ok(None),
    }
}

/// Saves the evaluated model as `best/` when its evaluation `eval` improves on the kept one by
/// `keep_best` (written to a temporary folder, then renamed over the old one). `seen` is the
/// model as the evaluation saw it and how its ranks hold it: in parts, it is saved from them
/// as a checkpoint is. The writer decides, from its `best/` and its evaluation (the frontier
/// is measured there).
fn keep_if_best<M: Module>(
    settings: &LoopSettings,
    run: &RunDir,
    store: &dyn ModelStore<M>,
    (model, parts): (&M, &SaveParts),
    step: usize,
    eval: &Map<String, Value>,
) -> Result<()> {
    let Some(key) = &settings.keep_best else {
        return Ok(());
    };
    let improved = decide(run, || {
        let value = eval.get(key).and_then(Value::as_f64).ok_or_else(|| {
            let known: Vec<&str> = eval.keys().map(String::as_str).collect();
            CoreError::Invalid(format!(
                "train.keep_best = {key:?}: the validation reports no such metric (it reports {})",
                known.join(", ")
            ))
        })?;
        let kept = best(settings, run)?;
        let better =
            value.is_finite() && kept.is_none_or(|best| settings.keep_best_mode.improves(value, best.value));
        Ok(better.then_some(value))
    })?;
    let Some(value) = improved else {
        return Ok(());
    };
    let reads_parameters = store.reads_parameters();
    if !parts.writes(run) {
        parts.help_save(model, reads_parameters)?;
    }
    run.write_shared(|| {
        let dir = run.join(BEST_DIR);
        let tmp = run.join(".tmp-best");
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| CoreError::cannot_write(&tmp, e))?;
        parts.save_on_writer(model, reads_parameters, |whole: &M| {
            store.save(&whole.valid(), &tmp)
        })?;
        let best = FinalStep {
            step,
            metric: key.clone(),
            value,
        };
        crate::checkpoint::write_json(&tmp.join(BEST_FILE), &best)?;
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&tmp, &dir).map_err(|e| CoreError::cannot_write(&dir, e))?;
        tracing::info!(step, metric = %key, value, "best validation so far");
        Ok(())
    })
}

/// Every rank's weights checksum against rank 0's after `step`.
fn check_in_sync<M: Module>(run: &RunDir, model: &M, step: usize) -> Result<()> {
    let sums = crate::parallel::gather(run.comm(), &grads::weights_checksum(model))?;
    if let Some(rank) = first_out_of_sync(&sums) {
        return Err(CoreError::Invalid(format!(
            "data parallel: rank {rank}'s weights differ from rank 0's after step {step} \
             (checksums {:?} and {:?}); the ranks no longer train one model",
            sums[rank], sums[0]
        )));
    }
    Ok(())
}

/// The first rank whose weights checksum differs from rank 0's (ranks apply the same reduced
/// gradients, so their weights are equal bit for bit unless something went wrong).
fn first_out_of_sync(sums: &[[f64; 2]]) -> Option<usize> {
    sums.iter().position(|s| s != &sums[0])
}

/// The error of a run whose loss turned `loss` at step `step` (0-based), naming the last
/// checkpoint a resume would start from.
pub fn non_finite(run: &RunDir, what: &str, loss: f64, step: usize, marker: &str) -> CoreError {
    let kept = match run.latest_checkpoint(marker) {
        Some((at, dir)) => format!("the last checkpoint, from step {at}, is {}", dir.display()),
        None => "no checkpoint was written yet".to_string(),
    };
    CoreError::Invalid(format!("{what} is {loss} at step {}; stopping: {kept}", step + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drifting_ranks_are_found() {
        assert_eq!(first_out_of_sync(&[[1.0, 2.0], [1.0, 2.0]]), None);
        assert_eq!(
            first_out_of_sync(&[[1.0, 2.0], [1.0, 2.0], [1.0, 2.000001]]),
            Some(2)
        );
    }

    #[test]
    fn older_checkpoints_states_still_read() {
        // PPO's (`step`, `seed`) and online DPO's (`step`) states of earlier versions.
        let ppo: LoopState = serde_json::from_str(r#"{"step": 4, "seed": 7}"#).unwrap();
        assert_eq!(
            (
                ppo.step,
                ppo.seed,
                ppo.total_steps,
                ppo.optimizer_shards,
                ppo.optimizer_rows
            ),
            (4, 7, 0, 0, false)
        );
        let online: LoopState = serde_json::from_str(r#"{"step": 2}"#).unwrap();
        assert_eq!(online.step, 2);
    }

    #[test]
    fn a_resumed_runs_step_0_evaluation_is_read_from_its_row() {
        let row: Map<String, Value> =
            serde_json::from_str(r#"{"step": 0.0, "eval_reward": 0.5, "reward": 1.0}"#).unwrap();
        assert_eq!(step_of(&row), Some(0));
        let eval = eval_of(Some(&row));
        assert_eq!(eval.len(), 1);
        assert_eq!(eval["eval_reward"], 0.5);
    }
}
