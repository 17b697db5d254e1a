//! RMSNorm as transformers computes it: `x · rsqrt(mean(x²) + ε) · w`, or Gemma's `· (1 + w)`.

use burn::module::{Module, Param};
use burn::tensor::{DType, Device, Tensor};

/// An RMSNorm whose scale is the stored weight `w` (HF's `.weight`), or `1 + w` (Gemma, whose
/// files store the offset from one: the weight trains, decays and saves as transformers has
/// it).
#[derive(Module, Debug)]
pub struct RmsNorm {
    pub gamma: Param<Tensor<1>>,
    pub epsilon: f64,
    #[module(skip)]
    pub unit_offset: bool,
}

impl RmsNorm {
    /// A norm of width `d` that starts as the identity scale (`w = 1`, or `w = 0` with the
    /// unit offset).
    pub fn new(d: usize, epsilon: f64, unit_offset: bool, device: &Device) -> Self {
        let gamma = if unit_offset {
            Tensor::zeros([d], device)
        } else {
            Tensor::ones([d], device)
        };
        Self {
            gamma: Param::from_tensor(gamma),
            epsilon,
            unit_offset,
        }
    }

    /// The width it normalises (its weight's length; the whole one's when the weight is a
    /// fully sharded trainer's shard).
    pub fn width(&self) -> usize {
        super::shard_spec(&self.gamma).map_or(self.gamma.dims()[0], |spec| spec.dims[0])
    }

    /// The factor the normalised values are multiplied by: `w`, or `1 + w` (in f32, as
    /// transformers adds it).
    pub fn scale(&self) -> Tensor<1> {
        let w = self.gamma.val();
        if self.unit_offset { w.add_scalar(1.0) } else { w }
    }

    /// [`RmsNorm::scale`] for normalising `x` (the weight gathered there when it is sharded).
    pub fn scale_for<const D: usize>(&self, x: &Tensor<D>) -> Tensor<1> {
        let w = super::param_value(&self.gamma, x);
        if self.unit_offset { w.add_scalar(1.0) } else { w }
    }

    /// Burn ops: `x · rsqrt(mean(x²) + ε) · scale` over the last axis, the mean square in f32.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let scale = self.scale_for(&x);
        self.forward_scaled(x, scale)
    }

    /// [`RmsNorm::forward`] with `scale`, this norm's [`RmsNorm::scale_for`] as the caller
    /// routes it (through a tensor group's sum of its gradient).
    pub fn forward_scaled<const D: usize>(&self, x: Tensor<D>, scale: Tensor<1>) -> Tensor<D> {
        let dtype = x.dtype();
        let rms = (x.clone().cast(DType::F32).square().mean_dim(D - 1) + self.epsilon).sqrt();
        (x / rms.cast(dtype)) * scale.cast(dtype).unsqueeze()
    }
}
