//! LoRA: a frozen linear layer plus a trainable low-rank update,
//! `y = x·W + b + (α/r)·dropout(x)·A·B`, computed through the rank-`r` path so the frozen
//! weight is never rebuilt or copied while training.

use burn::module::{Module, Param};
use burn::nn::{Dropout, DropoutConfig, Linear};
use burn::tensor::{Device, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{as_type_of, named_param, param_value, shard_spec, tensor_split};
use burn::tensor::module::linear;

/// The trainable factors of one adapted layer: `a: [in, r]`, `b: [r, out]` (Burn layout; PEFT's
/// `lora_A.weight` is `aᵀ`, `lora_B.weight` is `bᵀ`).
#[derive(Module, Debug)]
pub struct LoraAdapter {
    pub a: Param<Tensor<2>>,
    pub b: Param<Tensor<2>>,
    pub dropout: Dropout,
    /// `alpha / rank`.
    pub scale: f64,
}

impl LoraAdapter {
    /// PEFT's initialisation: `A` Kaiming-uniform, `B` zero, so the adapted layer starts equal
    /// to the base. `name` (the layer's HF prefix) makes the parameter ids stable.
    pub fn new(
        name: &str,
        d_in: usize,
        d_out: usize,
        rank: usize,
        alpha: f64,
        dropout: f64,
        device: &Device,
    ) -> Self {
        // kaiming_uniform_(a=√5) on a [r, in] weight: bound = 1/√in. Drawn from a stream seeded
        // by the layer's name, so runs (and their resumes) start from the same adapters.
        let bound = 1.0 / (d_in as f32).sqrt();
        let seed = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        });
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let values: Vec<f32> = (0..d_in * rank)
            .map(|_| rng.random_range(-bound..bound))
            .collect();
        let a = Tensor::<2>::from_data(TensorData::new(values, [d_in, rank]), device);
        Self {
            a: named_param(&format!("{name}.lora_A.weight"), a),
            b: named_param(
                &format!("{name}.lora_B.weight"),
                Tensor::zeros([rank, d_out], device),
            ),
            dropout: DropoutConfig::new(dropout).init(),
            scale: alpha / rank as f64,
        }
    }

    /// The low-rank update `scale · A·B`, `[in, out]`.
    pub fn delta(&self) -> Tensor<2> {
        self.a.val().matmul(self.b.val()).mul_scalar(self.scale)
    }
}

/// A linear layer that may carry a LoRA adapter.
#[derive(Module, Debug)]
pub struct LoraLinear {
    pub base: Linear,
    pub lora: Option<LoraAdapter>,
    /// When false the adapter is skipped: the layer computes the frozen base (a LoRA policy's
    /// reference model, with no second copy of the weights).
    pub adapter_enabled: bool,
}

impl From<Linear> for LoraLinear {
    fn from(base: Linear) -> Self {
        Self {
            base,
            lora: None,
            adapter_enabled: true,
        }
    }
}

impl LoraLinear {
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        if let Some(split) = tensor_split(&self.base.weight) {
            return self.forward_split(x, &split);
        }
        let bias = self
            .base
            .bias
            .as_ref()
            .map(|b| as_type_of(param_value(b, &x), &x));
        let y = match shard_spec(&self.base.weight) {
            // Fully sharded: the whole weight exists only inside the product (or, with
            // `train.keep_gathered`, from the forward to the backward, through `param_value`).
            Some(spec) if !aligner_parallel::shard::keeps_gathered() => {
                let [b, s, d] = x.dims();
                let out = spec.dims[1];
                let y = aligner_parallel::shard::shard_matmul(
                    x.clone().reshape([b * s, d]),
                    self.base.weight.val(),
                    spec,
                )
                .reshape([b, s, out]);
                match bias {
                    Some(bias) => y + bias.unsqueeze(),
                    None => y,
                }
            }
            _ => linear(
                x.clone(),
                as_type_of(param_value(&self.base.weight, &x), &x),
                bias,
            ),
        };
        match &self.lora {
            Some(lora) if self.adapter_enabled => {
                let [b, s, d] = x.dims();
                let low = lora
                    .dropout
                    .forward(x.clone())
                    .reshape([b * s, d])
                    .matmul(as_type_of(param_value(&lora.a, &x), &x))
                    .matmul(as_type_of(param_value(&lora.b, &x), &x));
                let [_, out] = low.dims();
                y + low.reshape([b, s, out]).mul_scalar(lora.scale)
            }
            _ => y,
        }
    }

    /// Tensor parallel: the weight `[in, out]` is this rank's block of columns (q, k, v, gate,
    /// up: column-parallel, the output a block of the whole output's columns) or of rows (o,
    /// down: row-parallel, the input a block of columns and the outputs summed over the group).
    /// The adapter is split the same way: `B`'s columns with a column-parallel layer (`A`
    /// whole, its product summed into every rank's gradient by `tp_copy`), `A`'s rows with a
    /// row-parallel one (its product summed over the group before `B`, which stays whole).
    fn forward_split(&self, x: Tensor<3>, split: &aligner_parallel::tensor::TensorSplit) -> Tensor<3> {
        use aligner_parallel::tensor::{tp_copy, tp_reduce};
        let group = &split.group;
        let [b, s, d] = x.dims();
        let weight = as_type_of(self.base.weight.val(), &x);
        let out = weight.dims()[1];
        let bias = self.base.bias.as_ref().map(|b| as_type_of(b.val(), &x));
        let adapter = self.lora.as_ref().filter(|_| self.adapter_enabled);
        let flat = x.reshape([b * s, d]);
        let y = if split.axis == 1 {
            let y = tp_copy(flat.clone(), group).matmul(weight);
            let y = match bias {
                Some(bias) => y + bias.unsqueeze(),
                None => y,
            };
            match adapter {
                Some(lora) => {
                    let (a, b) = (as_type_of(lora.a.val(), &y), as_type_of(lora.b.val(), &y));
                    let low = lora.dropout.forward(flat).matmul(a);
                    y + tp_copy(low, group).matmul(b).mul_scalar(lora.scale)
                }
                None => y,
            }
        } else {
            let mut y = flat.clone().matmul(weight);
            if let Some(lora) = adapter {
                // Through the sum of the parts of `x·A`, so that `B`'s gradient is whole.
                let low = tp_reduce(
                    lora.dropout.forward(flat).matmul(as_type_of(lora.a.val(), &y)),
                    group,
                );
                let y_low = low.matmul(as_type_of(lora.b.val(), &y)).mul_scalar(lora.scale);
                y = tp_reduce(y, group) + y_low;
            } else {
                y = tp_reduce(y, group);
            }
            match bias {
                Some(bias) => y + bias.unsqueeze(),
                None => y,
            }
        };
        y.reshape([b, s, out])
    }

    /// Freezes the base weights and attaches a fresh adapter.
    pub fn attach(&mut self, name: &str, rank: usize, alpha: f64, dropout: f64, device: &Device) {
        // A base read as a tensor group's block: the adapter is made whole, as one process
        // makes it, and cut into blocks with the rest of the model when training starts.
        let [d_in, d_out] = self.whole_dims();
        self.lora = Some(LoraAdapter::new(name, d_in, d_out, rank, alpha, dropout, device));
    }

    /// `[d_in, d_out]` of the whole weight, also where this rank holds a tensor group's block.
    pub fn whole_dims(&self) -> [usize; 2] {
        let dims = self.base.weight.dims();
        match aligner_parallel::tensor::split_of(self.base.weight.id.val(), &dims) {
            Some(split) => [split.dims[0], split.dims[1]],
            None => dims,
        }
    }

    /// The layer as it computes now, as a plain layer: the base with the adapter folded in
    /// (`W + scale·A·B`) when it is enabled.
    pub fn merged(&self) -> Linear {
        let mut base = self.base.clone();
        if let (Some(lora), true) = (&self.lora, self.adapter_enabled) {
            let w = base.weight.val() + lora.delta();
            base.weight = base.weight.map(|_| w);
        }
        base
    }
}
