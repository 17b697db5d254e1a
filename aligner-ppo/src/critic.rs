//! The critic and reward-model roles, and how the actor talks to them.
//!
//! A [`CriticWorker`] holds the value model (trained) and, when the roles are combined, the
//! reward model (frozen). The actor reaches it through a [`CriticClient`], whose calls return
//! at once with a [`Ticket`] to wait on later, so the critic's forward and training passes run
//! while the actor computes log-probs and trains. [`LocalCritic`] runs the worker on its own
//! thread (one process, the laptop default); the gRPC client in [`crate::server`] reaches one
//! served by `aligner serve critic`. Both see the same messages.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::Instant;

use aligner_core::config::Precision;
use aligner_core::reward::RewardModel;
use aligner_core::rm::RewardModelStore;
use aligner_core::start::LoadedRewardModel;
use aligner_core::train::grads::clip_grad_norm;
use aligner_core::train::master::{load_with_masters, save_with_masters};
use aligner_core::train::{load_optimizer, mini_batches, save_optimizer};
use burn::module::Module;
use burn::optim::{AdamWConfig, ModuleOptimizer};
use burn::tensor::Device;
use serde::{Deserialize, Serialize};

use crate::error::{PpoError, Result};
use crate::losses::clipped_value_loss;
use crate::rollout::{Layout, Sequence};

/// Values of every response token and (combined roles) each sequence's reward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InferReply {
    pub values: Vec<Vec<f32>>,
    /// Empty when the server holds no reward model.
    pub rewards: Vec<f32>,
    /// The critic's own compute time.
    pub seconds: f64,
}

/// A value update on a rollout: the targets come from the actor's GAE, the settings from the
/// actor's configuration (so a server needs none of its own).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainRequest {
    pub sequences: Vec<Sequence>,
    pub old_values: Vec<Vec<f32>>,
    pub returns: Vec<Vec<f32>>,
    pub settings: CriticSettings,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainReply {
    pub value_loss: f64,
    pub seconds: f64,
}

/// How the critic trains.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CriticSettings {
    pub lr: f64,
    pub clip_eps: f64,
    pub epochs: usize,
    pub mini_batch: usize,
    pub max_grad_norm: f64,
}

/// The value model, its optimiser, and optionally the reward model.
pub struct CriticWorker {
    value: RewardModel,
    reward: Option<RewardModel>,
    optim: ModuleOptimizer,
    store: RewardModelStore,
    device: Device,
}

impl CriticWorker {
    /// `value` starts the critic (NeMo-Aligner starts it from the reward model); `reward`
    /// scores responses when the roles are combined.
    pub fn new(
        value: RewardModel,
        reward: Option<RewardModel>,
        store: RewardModelStore,
        device: &Device,
    ) -> Self {
        Self {
            value: value.fork(&device.clone().autodiff()).train(),
            reward,
            optim: critic_optimizer(),
            store,
            device: device.clone(),
        }
    }

    /// Per-token values (the state before each response token) and rewards (at the last token).
    pub fn infer(&self, sequences: &[Sequence]) -> Result<InferReply> {
        let started = Instant::now();
        let layout = Layout::new(sequences, &self.device);
        let value = self.value.valid();
        let values = value.forward_all(layout.tokens.clone(), &layout.positions, Some(&layout.mask));
        let [b, s, _] = values.dims();
        let values = layout.ragged(layout.response_columns(values.reshape([b, s])));
        let rewards = match &self.reward {
            Some(rm) => rewards_of(rm, &layout)?,
            None => Vec::new(),
        };
        Ok(InferReply {
            values,
            rewards,
            seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// `epochs` passes of the clipped value loss over the rollout in mini-batches.
    pub fn train(&mut self, request: &TrainRequest) -> Result<TrainReply> {
        let started = Instant::now();
        let settings = &request.settings;
        let n = request.sequences.len();
        let train_device = self.device.clone().autodiff();
        let (mut loss_sum, mut batches) = (0.0, 0usize);
        for range in mini_batches(n, settings.mini_batch, settings.epochs) {
            let layout = Layout::new(&request.sequences[range.clone()], &train_device);
            let old = layout.padded(&request.old_values[range.clone()], &train_device);
            let returns = layout.padded(&request.returns[range], &train_device);
            let values = self
                .value
                .forward_all(layout.tokens.clone(), &layout.positions, Some(&layout.mask));
            let [b, s, _] = values.dims();
            let values = layout.response_columns(values.reshape([b, s]));
            let loss = clipped_value_loss(values, old, returns, &layout.response_mask, settings.clip_eps);
            loss_sum += loss.clone().into_scalar::<f32>() as f64;
            batches += 1;
            let mut grads = aligner_core::model::recompute::gradients(loss, &self.value);
            clip_grad_norm(&self.value, &mut grads, settings.max_grad_norm);
            self.value = self.optim.step(settings.lr, self.value.clone(), grads);
        }
        Ok(TrainReply {
            value_loss: loss_sum / batches.max(1) as f64,
            seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// Writes the value model (HF folder, with its f32 master weights when it computes in
    /// half precision) and its optimiser state into `dir`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        save_with_masters(&self.store, &self.value.valid(), dir)?;
        save_optimizer(&self.optim, &dir.join("optimizer.bin"))?;
        Ok(())
    }

    /// Restores what [`CriticWorker::save`] wrote.
    pub fn load(&mut self, dir: &Path) -> Result<()> {
        let train_device = self.device.clone().autodiff();
        self.value = load_with_masters(&self.store, dir, &train_device)?.train();
        self.optim = load_optimizer(critic_optimizer(), &dir.join("optimizer.bin"))?;
        Ok(())
    }

    /// A worker started from the model folder `value_dir` (a reward model, NeMo-Aligner's
    /// choice, or a causal LM), holding the reward model of `reward_dir` when the roles share a
    /// process: what `aligner serve critic` starts. Both compute in `precision` (the critic
    /// trains on f32 master weights and saves in that type).
    pub fn from_dirs(
        value_dir: &Path,
        reward_dir: Option<&Path>,
        device: &Device,
        precision: Precision,
    ) -> Result<Self> {
        let value = LoadedRewardModel::starting_from(value_dir, device)?.in_precision(precision, device)?;
        let reward = reward_dir
            .map(|dir| reward_model(dir, device, precision))
            .transpose()?;
        let store = value.store();
        Ok(Self::new(single_output(value)?, reward, store, device))
    }
}

/// The critic's AdamW (no weight decay; Burn's default ε).
fn critic_optimizer() -> ModuleOptimizer {
    AdamWConfig::new().with_weight_decay(0.0).init()
}

/// The reward model of folder `dir` on `device`, computing in `precision`.
pub fn reward_model(dir: &Path, device: &Device, precision: Precision) -> Result<RewardModel> {
    single_output(LoadedRewardModel::from_dir(dir, device)?.in_precision(precision, device)?)
}

/// The model of a reward-model folder, which must have one output (a scalar score).
pub fn single_output(loaded: LoadedRewardModel) -> Result<RewardModel> {
    if loaded.labels.len() != 1 {
        return Err(PpoError::Invalid(format!(
            "{}: a reward model has one output; this one has {} ({:?})",
            loaded.dir.display(),
            loaded.labels.len(),
            loaded.labels
        )));
    }
    Ok(loaded.model)
}

/// The reward model's score at each sequence's last token (on the reward model's own device,
/// which is the host's when it is offloaded).
pub fn rewards_of(rm: &RewardModel, layout: &Layout) -> Result<Vec<f32>> {
    let device = rm.score.weight.device();
    let scores = rm.forward_all(
        layout.tokens.clone().to_device(&device),
        &layout.positions.clone().to_device(&device),
        Some(&layout.mask.clone().to_device(&device)),
    );
    let [b, s, _] = scores.dims();
    let flat: Vec<f32> = scores
        .reshape([b, s])
        .into_data()
        .try_to_vec::<f32>()
        .map_err(|e| PpoError::Critic(format!("{e:?}")))?;
    Ok(layout
        .lengths
        .iter()
        .enumerate()
        .map(|(i, &len)| flat[i * s + layout.prompt_width + len.max(1) - 1])
        .collect())
}

/// [`rewards_of`] over `sequences` in batches of `batch`.
pub fn rewards_in_batches(
    rm: &RewardModel,
    sequences: &[Sequence],
    batch: usize,
    device: &Device,
) -> Result<Vec<f32>> {
    let mut all = Vec::with_capacity(sequences.len());
    for chunk in sequences.chunks(batch.max(1)) {
        all.extend(rewards_of(rm, &Layout::new(chunk, device))?);
    }
    Ok(all)
}

/// A reply the actor waits for later.
pub struct Ticket<T> {
    reply: Receiver<Result<T>>,
}

impl<T> Ticket<T> {
    pub fn channel() -> (Sender<Result<T>>, Self) {
        let (tx, rx) = channel();
        (tx, Self { reply: rx })
    }

    /// Blocks until the answer arrives.
    pub fn wait(self) -> Result<T> {
        self.reply
            .recv()
            .map_err(|_| PpoError::Critic("the critic stopped before answering".into()))?
    }
}

/// How the actor reaches the critic: every call returns at once.
pub trait CriticClient: Send {
    fn infer(&self, sequences: Vec<Sequence>) -> Ticket<InferReply>;
    fn train(&self, request: TrainRequest) -> Ticket<TrainReply>;
    /// Saves the critic's state into `dir` (a checkpoint folder of the run).
    fn save(&self, dir: PathBuf) -> Ticket<()>;
    /// Restores the critic's state from `dir`.
    fn load(&self, dir: PathBuf) -> Ticket<()>;
}

enum Job {
    Infer(Vec<Sequence>, Sender<Result<InferReply>>),
    Train(TrainRequest, Sender<Result<TrainReply>>),
    Save(PathBuf, Sender<Result<()>>),
    Load(PathBuf, Sender<Result<()>>),
}

/// A [`CriticWorker`] on its own thread, answering in request order.
pub struct LocalCritic {
    jobs: Sender<Job>,
}

impl LocalCritic {
    pub fn spawn(mut worker: CriticWorker) -> Self {
        let (jobs, queue) = channel::<Job>();
        std::thread::spawn(move || {
            for job in queue {
                // A dropped ticket only means the actor stopped waiting.
                match job {
                    Job::Infer(seqs, tx) => drop(tx.send(worker.infer(&seqs))),
                    Job::Train(req, tx) => drop(tx.send(worker.train(&req))),
                    Job::Save(dir, tx) => drop(tx.send(worker.save(&dir))),
                    Job::Load(dir, tx) => drop(tx.send(worker.load(&dir))),
                }
            }
        });
        Self { jobs }
    }

    fn submit<T>(&self, job: impl FnOnce(Sender<Result<T>>) -> Job) -> Ticket<T> {
        let (tx, ticket) = Ticket::channel();
        // If the worker thread is gone, the ticket's sender is dropped and `wait` reports it.
        let _ = self.jobs.send(job(tx));
        ticket
    }
}

impl CriticClient for LocalCritic {
    fn infer(&self, sequences: Vec<Sequence>) -> Ticket<InferReply> {
        self.submit(|tx| Job::Infer(sequences, tx))
    }
    fn train(&self, request: TrainRequest) -> Ticket<TrainReply> {
        self.submit(|tx| Job::Train(request, tx))
    }
    fn save(&self, dir: PathBuf) -> Ticket<()> {
        self.submit(|tx| Job::Save(dir, tx))
    }
    fn load(&self, dir: PathBuf) -> Ticket<()> {
        self.submit(|tx| Job::Load(dir, tx))
    }
}
