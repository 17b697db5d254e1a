//! A mixture of experts in place of the MLP (Mixtral's `block_sparse_moe`, Qwen3-MoE's sparse
//! `mlp`): a linear router picks each token's `top_k` experts, whose outputs are summed with
//! the router's probabilities. Experts run grouped: each one once, on the tokens routed to it.
//!
//! Training adds Switch Transformer's load-balancing loss, as transformers does when the config
//! sets `output_router_logits`: the routing of every sparse layer is recorded while a step's
//! loss is computed inside [`with_router_loss`], which returns the loss term to add.

use std::cell::RefCell;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::softmax;
use burn::tensor::{Device, FloatDType, IndexingUpdateOp, Int, Tensor, TensorData};

use super::layer::Mlp;
use super::lora::LoraLinear;
use crate::config::{LlamaConfig, MoeSpec};

/// How a family names its experts in checkpoints (and PEFT's `target_modules`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertNaming {
    /// `block_sparse_moe.experts.E.{w1, w3, w2}` (gate, up, down).
    Mixtral,
    /// `mlp.experts.E.{gate_proj, up_proj, down_proj}`.
    Qwen3Moe,
}

impl ExpertNaming {
    /// The block's HF name under its layer (`block_sparse_moe`, `mlp`).
    pub fn block(self) -> &'static str {
        match self {
            ExpertNaming::Mixtral => "block_sparse_moe",
            ExpertNaming::Qwen3Moe => "mlp",
        }
    }

    /// An expert's gate and up projections' names, then its down projection's.
    pub fn projections(self) -> ([&'static str; 2], &'static str) {
        match self {
            ExpertNaming::Mixtral => (["w1", "w3"], "w2"),
            ExpertNaming::Qwen3Moe => (["gate_proj", "up_proj"], "down_proj"),
        }
    }

    /// The family's name of a projection given by its Llama name (`gate_proj` is Mixtral's
    /// `w1`), as LoRA targets are matched.
    pub fn rename(self, llama: &str) -> &str {
        match (self, llama) {
            (ExpertNaming::Mixtral, "gate_proj") => "w1",
            (ExpertNaming::Mixtral, "up_proj") => "w3",
            (ExpertNaming::Mixtral, "down_proj") => "w2",
            (_, other) => other,
        }
    }
}

/// A layer's feed-forward block: a dense gated MLP, or a mixture of experts.
// One per layer, built once: the size of the dense variant costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum FeedForward {
    Dense(Mlp),
    Sparse(SparseMoe),
}

impl FeedForward {
    /// Layer `index`'s block for `config` (sparse where the config's experts are).
    pub fn new(config: &LlamaConfig, index: usize, device: &Device) -> Self {
        match config.moe().ok().flatten() {
            Some(spec) if spec.sparse_layers.get(index).copied().unwrap_or(false) => {
                FeedForward::Sparse(SparseMoe::new(config, &spec, device))
            }
            _ => FeedForward::Dense(Mlp::new(config, config.intermediate_size, device)),
        }
    }

    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward(x),
            FeedForward::Sparse(moe) => moe.forward(x),
        }
    }

    /// Every gated MLP of the block: the dense one, or each expert.
    pub fn mlps(&self) -> Vec<&Mlp> {
        match self {
            FeedForward::Dense(mlp) => vec![mlp],
            FeedForward::Sparse(moe) => moe.experts.iter().collect(),
        }
    }

    /// The block's parts under their HF names relative to the layer's, in checkpoint order: a
    /// mixture's router (`block_sparse_moe.gate`), then every projection of its gated MLPs
    /// (`mlp.gate_proj`, ..., or `block_sparse_moe.experts.3.w1`, ...).
    pub fn named_parts_mut(&mut self) -> NamedParts<'_> {
        let mut projections = Vec::new();
        let router = match self {
            FeedForward::Dense(mlp) => {
                let names = mlp.projection_names();
                named_projections(&mut projections, "mlp".to_string(), names, "down_proj", mlp);
                None
            }
            FeedForward::Sparse(moe) => {
                let block = moe.naming.block();
                let (gate_up, down) = moe.naming.projections();
                for (e, expert) in moe.experts.iter_mut().enumerate() {
                    let prefix = format!("{block}.experts.{e}");
                    named_projections(&mut projections, prefix, &gate_up, down, expert);
                }
                Some((format!("{block}.gate"), &mut moe.router))
            }
        };
        NamedParts { router, projections }
    }
}

/// [`FeedForward::named_parts_mut`]: the parts under their names relative to the layer's.
pub struct NamedParts<'a> {
    pub router: Option<(String, &'a mut Linear)>,
    pub projections: Vec<(String, &'a mut LoraLinear)>,
}

/// `mlp`'s projections named `prefix.<name>`: gate/up as `gate_up` names them, then `down`.
fn named_projections<'a>(
    out: &mut Vec<(String, &'a mut LoraLinear)>,
    prefix: String,
    gate_up: &[&str],
    down: &str,
    mlp: &'a mut Mlp,
) {
    let named = gate_up.iter().zip(mlp.gate_up.iter_mut());
    out.extend(named.map(|(name, proj)| (format!("{prefix}.{name}"), proj)));
    out.push((format!("{prefix}.{down}"), &mut mlp.down_proj));
}

/// A router and its experts.
#[derive(Module, Debug)]
pub struct SparseMoe {
    /// HF's `gate`: `[hidden, experts]`, no bias.
    pub router: Linear,
    pub experts: Vec<Mlp>,
    #[module(skip)]
    pub top_k: usize,
    #[module(skip)]
    pub normalize_top_k: bool,
    /// `router_aux_loss_coef` when the load-balancing loss is added in training.
    #[module(skip)]
    pub aux_loss_coef: Option<f64>,
    #[module(skip)]
    pub naming: ExpertNaming,
}

impl SparseMoe {
    pub fn new(config: &LlamaConfig, spec: &MoeSpec, device: &Device) -> Self {
        Self {
            router: LinearConfig::new(config.hidden_size, spec.experts)
                .with_bias(false)
                .init(device),
            experts: (0..spec.experts)
                .map(|_| Mlp::new(config, spec.expert_width, device))
                .collect(),
            top_k: spec.top_k,
            normalize_top_k: spec.normalize_top_k,
            aux_loss_coef: spec.aux_loss_coef,
            naming: if config.model_type == "mixtral" {
                ExpertNaming::Mixtral
            } else {
                ExpertNaming::Qwen3Moe
            },
        }
    }

    /// `Σ_k w_k · expert_k(x)` per token of `x: [batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, s, d] = x.dims();
        let n = b * s;
        let device = x.device();
        let flat = x.reshape([n, d]);
        let router = super::as_type_of(super::param_value(&self.router.weight, &flat), &flat);
        // The router's softmax in f32, as transformers computes it.
        let probs = softmax(flat.clone().matmul(router).cast(FloatDType::F32), 1);
        let experts = self.experts.len();
        // Which experts a token goes to is a discrete choice, made on the host; the weights
        // it gets stay in the graph (gathered from the probabilities).
        let host: Vec<f32> = probs
            .clone()
            .detach()
            .into_data()
            .convert::<f32>()
            .try_into_vec()
            .expect("router probabilities are floats");
        let chosen = top_k_rows(&host, experts, self.top_k);
        let index = Tensor::<2, Int>::from_data(
            TensorData::new(
                chosen.iter().map(|&e| e as i64).collect::<Vec<_>>(),
                [n, self.top_k],
            ),
            &device,
        );
        let mut weights = probs.clone().gather(1, index);
        if self.normalize_top_k {
            weights = weights.clone() / weights.sum_dim(1);
        }
        let weights = weights
            .cast(FloatDType::from(flat.dtype()))
            .reshape([n * self.top_k]);
        // Each expert's tokens, and where their weights sit in `weights`.
        let mut routed: Vec<(Vec<i64>, Vec<i64>)> = vec![(Vec::new(), Vec::new()); experts];
        for (slot, &e) in chosen.iter().enumerate() {
            routed[e].0.push((slot / self.top_k) as i64);
            routed[e].1.push(slot as i64);
        }
        let mut out = flat.zeros_like();
        for (expert, (tokens, slots)) in self.experts.iter().zip(&routed) {
            if tokens.is_empty() {
                if aligner_parallel::shard::active() {
                    // Fully sharded, an expert's weights are gathered in its forward and
                    // backward (collectives): every rank runs every expert, one without
                    // tokens on the first token at weight 0.
                    let first = Tensor::<1, Int>::from_data(TensorData::new(vec![0i64], [1]), &device);
                    let input = flat.clone().select(0, first.clone()).reshape([1, 1, d]);
                    let y = expert.forward(input).reshape([1, d]).mul_scalar(0.0);
                    out = out.select_assign(0, first, y, IndexingUpdateOp::Add);
                }
                continue;
            }
            let m = tokens.len();
            let tokens = Tensor::<1, Int>::from_data(TensorData::new(tokens.clone(), [m]), &device);
            let slots = Tensor::<1, Int>::from_data(TensorData::new(slots.clone(), [m]), &device);
            let input = flat.clone().select(0, tokens.clone()).reshape([1, m, d]);
            let y = expert.forward(input).reshape([m, d]);
            let y = y * weights.clone().select(0, slots).reshape([m, 1]);
            out = out.select_assign(0, tokens, y, IndexingUpdateOp::Add);
        }
        // A recomputed pass (`train.activation_checkpointing`) runs untracked and records its
        // routing too: the load-balancing loss takes its value, and the layer's rerun its
        // gradient (see `recompute`).
        if let Some(coef) = self.aux_loss_coef
            && (probs.is_tracked() || super::recompute::records_untracked_routing())
        {
            // Padding is left out, as transformers leaves out what the attention mask hides.
            let valid = VALID_TOKENS.with(|v| v.borrow().clone().filter(|v| v.len() == n));
            let is_valid = |row: usize| valid.as_ref().is_none_or(|v| v[row]);
            let mut counts = vec![0.0f32; experts];
            for (slot, &e) in chosen.iter().enumerate() {
                if is_valid(slot / self.top_k) {
                    counts[e] += 1.0;
                }
            }
            let (probability_sums, rows) = match &valid {
                None => (probs.sum_dim(0), n),
                Some(valid) => {
                    let mask: Vec<f32> = valid.iter().map(|&v| f32::from(u8::from(v))).collect();
                    let mask = Tensor::<2>::from_data(TensorData::new(mask, [n, 1]), &device);
                    ((probs * mask).sum_dim(0), valid.iter().filter(|&&v| v).count())
                }
            };
            record_routing(Routing {
                probability_sums: probability_sums.reshape([experts]),
                counts,
                rows,
                coef,
            });
        }
        out.reshape([b, s, d])
    }
}

/// Each row's `k` largest entries' indices, largest first (`values: [rows, width]`).
pub fn top_k_rows(values: &[f32], width: usize, k: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(values.len() / width * k);
    let mut order: Vec<usize> = Vec::with_capacity(width);
    for row in values.chunks(width) {
        order.clear();
        order.extend(0..width);
        // Stable: ties go to the lower index.
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        out.extend_from_slice(&order[..k]);
    }
    out
}

/// One sparse layer's routing in a forward pass: what the load-balancing loss needs.
struct Routing {
    /// `Σ_tokens p(expert)`, `[experts]`, in the graph.
    probability_sums: Tensor<1>,
    /// How many of the tokens' top-k choices went to each expert.
    counts: Vec<f32>,
    rows: usize,
    coef: f64,
}

thread_local! {
    /// The routings recorded inside [`with_router_loss`] (none outside it).
    static ROUTINGS: RefCell<Option<Vec<Routing>>> = const { RefCell::new(None) };
}

thread_local! {
    /// Which tokens of the forward passes inside [`with_valid_tokens`] are not padding.
    static VALID_TOKENS: RefCell<Option<Vec<bool>>> = const { RefCell::new(None) };
}

/// Runs `f` (forward passes over a padded batch) with `valid` marking its tokens that are
/// not padding (`[batch · seq]`, row by row): the load-balancing loss leaves the others out,
/// as transformers' does with an attention mask. A pass over another number of tokens
/// counts every token.
pub fn with_valid_tokens<T>(valid: Vec<bool>, f: impl FnOnce() -> T) -> T {
    with_valid_tokens_as(Some(valid), f)
}

/// [`with_valid_tokens`] with the marking a pass ran under ([`valid_tokens`]): `None`, every
/// token counts.
pub(super) fn with_valid_tokens_as<T>(valid: Option<Vec<bool>>, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<Vec<bool>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let outer = self.0.take();
            VALID_TOKENS.with(|v| *v.borrow_mut() = outer);
        }
    }
    let _restore = Restore(VALID_TOKENS.with(|v| std::mem::replace(&mut *v.borrow_mut(), valid)));
    f()
}

/// The tokens marked as not padding for the passes running now (see [`with_valid_tokens`]).
pub(super) fn valid_tokens() -> Option<Vec<bool>> {
    VALID_TOKENS.with(|v| v.borrow().clone())
}

/// Runs `f` (a recomputed layer's rerun), returning its value and the sum of the router
/// probability sums its sparse layers recorded (`None` without any): what the load-balancing
/// loss's gradient reaches the layer through.
pub(super) fn capture_router_sums<T>(f: impl FnOnce() -> T) -> (T, Option<Tensor<1>>) {
    let (value, routings) = recording_routings(f);
    let sums = routings
        .into_iter()
        .map(|r| r.probability_sums)
        .reduce(|a, b| a + b);
    (value, sums)
}

/// Runs `f` with the routings of its sparse layers recorded (the enclosing scope's recordings
/// kept apart and restored): `f`'s value and what it recorded.
fn recording_routings<T>(f: impl FnOnce() -> T) -> (T, Vec<Routing>) {
    let outer = ROUTINGS.with(|r| r.borrow_mut().replace(Vec::new()));
    let scope = Scope(outer);
    let value = f();
    let routings = ROUTINGS.with(|r| r.borrow_mut().take()).unwrap_or_default();
    drop(scope);
    (value, routings)
}

fn record_routing(routing: Routing) {
    ROUTINGS.with(|r| {
        if let Some(list) = r.borrow_mut().as_mut() {
            list.push(routing);
        }
    });
}

/// Restores the enclosing scope's recordings when a scope ends, even by a panic.
struct Scope(Option<Vec<Routing>>);

impl Drop for Scope {
    fn drop(&mut self) {
        let outer = self.0.take();
        ROUTINGS.with(|r| *r.borrow_mut() = outer);
    }
}

/// Runs `f` (a training step's loss), recording the routing of every sparse layer whose
/// load-balancing loss is on and whose router takes gradients; returns `f`'s value and the
/// term to add to the loss, `router_aux_loss_coef · load_balancing_loss` (`None` for a dense
/// model or without `output_router_logits`).
pub fn with_router_loss<T>(f: impl FnOnce() -> T) -> (T, Option<Tensor<1>>) {
    let recomputed_from = super::recompute::tape_len();
    let (value, routings) = recording_routings(f);
    let recomputed = recomputed_from..super::recompute::tape_len();
    let Some(first) = routings.first() else {
        return (value, None);
    };
    let coef = first.coef;
    let experts = first.counts.len();
    let mut counts = vec![0.0f32; experts];
    let mut rows = 0;
    let add = |sums: Option<Tensor<1>>, more: Tensor<1>| match sums {
        Some(s) => s + more,
        None => more,
    };
    // Recomputed passes' sums are untracked: they enter the loss through one leaf, whose
    // gradient (the same for every layer: the loss is linear in the sums) their reruns take.
    let (mut sums, mut untracked): (Option<Tensor<1>>, Option<Tensor<1>>) = (None, None);
    for r in routings {
        counts.iter_mut().zip(&r.counts).for_each(|(c, x)| *c += x);
        rows += r.rows;
        if r.probability_sums.is_tracked() {
            sums = Some(add(sums, r.probability_sums));
        } else {
            untracked = Some(add(untracked, r.probability_sums));
        }
    }
    if let Some(untracked) = untracked {
        let leaf = untracked.require_grad();
        super::recompute::attach_router_leaf(recomputed, &leaf);
        sums = Some(add(sums, leaf));
    }
    let sums = sums.expect("at least one routing");
    let loss = load_balancing_loss(sums, &counts, rows);
    (value, Some(loss.mul_scalar(coef)))
}

/// Switch Transformer's load-balancing loss as transformers' `load_balancing_loss_func` computes
/// it over the layers of a pass: `E · Σ_e (count_e / R) · (Σp_e / R)`, where `count_e` is how
/// often expert `e` is among a token's top-k, `Σp_e` the sum of its router probabilities, both
/// summed over layers and tokens, and `R` the number of (layer, token) rows. `[1]`.
pub fn load_balancing_loss(probability_sums: Tensor<1>, counts: &[f32], rows: usize) -> Tensor<1> {
    let experts = counts.len();
    let fractions: Vec<f32> = counts.iter().map(|c| c / rows as f32).collect();
    let fractions = Tensor::<1>::from_data(TensorData::new(fractions, [experts]), &probability_sums.device());
    (probability_sums.div_scalar(rows as f64) * fractions)
        .sum()
        .mul_scalar(experts as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_picks_the_largest_first_and_ties_to_the_lower_index() {
        let rows = [0.1, 0.5, 0.2, 0.2, 0.3, 0.3, 0.1, 0.3];
        assert_eq!(top_k_rows(&rows, 4, 2), vec![1, 2, 0, 1]);
    }

    /// Two tokens, two experts, top-1, by hand: token 0 picks expert 0 (p = 0.7, 0.3), token 1
    /// expert 1 (p = 0.4, 0.6): fractions 1/2, 1/2; mean probabilities 0.55, 0.45; loss =
    /// 2 · (0.5 · 0.55 + 0.5 · 0.45) = 1. Then all on expert 0: 2 · (1 · 0.55) = 1.1.
    #[test]
    fn load_balancing_loss_by_hand() {
        let device = Device::flex();
        let sums = Tensor::<1>::from_data(TensorData::new(vec![1.1f32, 0.9], [2]), &device);
        let even: f32 = load_balancing_loss(sums.clone(), &[1.0, 1.0], 2).into_scalar();
        assert!((even - 1.0).abs() < 1e-6, "{even}");
        let skewed: f32 = load_balancing_loss(sums, &[2.0, 0.0], 2).into_scalar();
        assert!((skewed - 1.1).abs() < 1e-6, "{skewed}");
    }
}
