//! The critic service's protobuf messages (schema in `proto/critic.proto`) and their
//! conversions to the crate's own types.

use crate::critic::{CriticSettings, InferReply as Infer, TrainReply as Trained, TrainRequest as Train};
use crate::rollout::Sequence as Seq;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Empty {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Health {
    /// Random per server start: a changed id means the server restarted and lost its state.
    #[prost(uint64, tag = "1")]
    pub instance: u64,
    #[prost(bool, tag = "2")]
    pub has_reward_model: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Sequence {
    #[prost(uint32, repeated, tag = "1")]
    pub prompt_ids: Vec<u32>,
    #[prost(uint32, repeated, tag = "2")]
    pub response_ids: Vec<u32>,
    #[prost(bool, repeated, tag = "3")]
    pub observed: Vec<bool>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Row {
    #[prost(float, repeated, tag = "1")]
    pub values: Vec<f32>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct InferRequest {
    #[prost(message, repeated, tag = "1")]
    pub sequences: Vec<Sequence>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct InferReply {
    #[prost(message, repeated, tag = "1")]
    pub values: Vec<Row>,
    #[prost(float, repeated, tag = "2")]
    pub rewards: Vec<f32>,
    #[prost(double, tag = "3")]
    pub seconds: f64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Settings {
    #[prost(double, tag = "1")]
    pub lr: f64,
    #[prost(double, tag = "2")]
    pub clip_eps: f64,
    #[prost(uint32, tag = "3")]
    pub epochs: u32,
    #[prost(uint32, tag = "4")]
    pub mini_batch: u32,
    #[prost(double, tag = "5")]
    pub max_grad_norm: f64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TrainRequest {
    #[prost(message, repeated, tag = "1")]
    pub sequences: Vec<Sequence>,
    #[prost(message, repeated, tag = "2")]
    pub old_values: Vec<Row>,
    #[prost(message, repeated, tag = "3")]
    pub returns: Vec<Row>,
    #[prost(message, optional, tag = "4")]
    pub settings: Option<Settings>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TrainReply {
    #[prost(double, tag = "1")]
    pub value_loss: f64,
    #[prost(double, tag = "2")]
    pub seconds: f64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PathRequest {
    #[prost(string, tag = "1")]
    pub path: String,
}

fn rows(x: &[Vec<f32>]) -> Vec<Row> {
    x.iter().map(|v| Row { values: v.clone() }).collect()
}

fn unrows(x: Vec<Row>) -> Vec<Vec<f32>> {
    x.into_iter().map(|r| r.values).collect()
}

pub fn sequences(x: &[Seq]) -> Vec<Sequence> {
    x.iter()
        .map(|s| Sequence {
            prompt_ids: s.prompt_ids.clone(),
            response_ids: s.response_ids.clone(),
            observed: s.observed.clone(),
        })
        .collect()
}

pub fn unsequences(x: Vec<Sequence>) -> Vec<Seq> {
    x.into_iter()
        .map(|s| Seq {
            prompt_ids: s.prompt_ids,
            response_ids: s.response_ids,
            observed: s.observed,
        })
        .collect()
}

impl From<&Infer> for InferReply {
    fn from(r: &Infer) -> Self {
        Self {
            values: rows(&r.values),
            rewards: r.rewards.clone(),
            seconds: r.seconds,
        }
    }
}

impl From<InferReply> for Infer {
    fn from(r: InferReply) -> Self {
        Self {
            values: unrows(r.values),
            rewards: r.rewards,
            seconds: r.seconds,
        }
    }
}

impl From<&Train> for TrainRequest {
    fn from(r: &Train) -> Self {
        let s = &r.settings;
        Self {
            sequences: sequences(&r.sequences),
            old_values: rows(&r.old_values),
            returns: rows(&r.returns),
            settings: Some(Settings {
                lr: s.lr,
                clip_eps: s.clip_eps,
                epochs: s.epochs as u32,
                mini_batch: s.mini_batch as u32,
                max_grad_norm: s.max_grad_norm,
            }),
        }
    }
}

impl From<TrainRequest> for Train {
    fn from(r: TrainRequest) -> Self {
        let s = r.settings.unwrap_or_default();
        Self {
            sequences: unsequences(r.sequences),
            old_values: unrows(r.old_values),
            returns: unrows(r.returns),
            settings: CriticSettings {
                lr: s.lr,
                clip_eps: s.clip_eps,
                epochs: s.epochs as usize,
                mini_batch: s.mini_batch as usize,
                max_grad_norm: s.max_grad_norm,
            },
        }
    }
}

impl From<&Trained> for TrainReply {
    fn from(r: &Trained) -> Self {
        Self {
            value_loss: r.value_loss,
            seconds: r.seconds,
        }
    }
}

impl From<TrainReply> for Trained {
    fn from(r: TrainReply) -> Self {
        Self {
            value_loss: r.value_loss,
            seconds: r.seconds,
        }
    }
}
