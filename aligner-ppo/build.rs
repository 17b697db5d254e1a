//! Generates the critic service's gRPC client and server (messages are plain Rust structs
//! with prost derives in `src/server/wire.rs`; `proto/critic.proto` documents the same schema
//! for clients in other languages). No protoc is needed.

fn main() {
    let method = |name: &str, route: &str, input: &str, output: &str| {
        tonic_prost_build::manual::Method::builder()
            .name(name)
            .route_name(route)
            .input_type(format!("crate::server::wire::{input}"))
            .output_type(format!("crate::server::wire::{output}"))
            .codec_path("tonic_prost::ProstCodec")
            .build()
    };
    let service = tonic_prost_build::manual::Service::builder()
        .name("Critic")
        .package("aligner.critic")
        .method(method("health", "Health", "Empty", "Health"))
        .method(method("infer", "Infer", "InferRequest", "InferReply"))
        .method(method("train", "Train", "TrainRequest", "TrainReply"))
        .method(method("save", "Save", "PathRequest", "Empty"))
        .method(method("load", "Load", "PathRequest", "Empty"))
        .build();
    tonic_prost_build::manual::Builder::new().compile(&[service]);
}
