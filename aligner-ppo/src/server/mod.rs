//! The critic as a gRPC service (`aligner serve critic`), and the actor's client for it.
//!
//! The server wraps one [`CriticWorker`]; requests run one at a time on a blocking thread.
//! [`RemoteCritic`] implements [`CriticClient`]: every call is sent from a background runtime
//! and returns a ticket at once. An unreachable server is retried with exponential back-off
//! for `ppo.critic_retry_seconds`, then the run stops with an error that says what to do; a
//! server that comes back *restarted* (a new instance id: its trained state is gone) stops the
//! run at once rather than train on from the wrong critic.

pub mod wire;

#[allow(clippy::all, missing_docs)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/aligner.critic.Critic.rs"));
}

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use generated::critic_client::CriticClient as GrpcClient;
use generated::critic_server::{Critic, CriticServer};
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Request, Response, Status};

use crate::critic::{CriticClient, CriticWorker, InferReply, Ticket, TrainReply, TrainRequest};
use crate::error::{PpoError, Result};
use crate::rollout::Sequence;

/// Rollouts of long responses are large messages.
const MAX_MESSAGE: usize = 1 << 30;

struct Service {
    worker: Arc<Mutex<CriticWorker>>,
    instance: u64,
    has_reward_model: bool,
}

fn internal(e: impl std::fmt::Display) -> Status {
    Status::internal(e.to_string())
}

impl Service {
    /// Runs `job` on the worker on a blocking thread.
    async fn run<T: Send + 'static>(
        &self,
        job: impl FnOnce(&mut CriticWorker) -> Result<T> + Send + 'static,
    ) -> Result<T, Status> {
        let worker = self.worker.clone();
        tokio::task::spawn_blocking(move || {
            let mut guard = worker.lock().unwrap_or_else(|e| e.into_inner());
            job(&mut guard)
        })
        .await
        .map_err(internal)?
        .map_err(internal)
    }
}

#[tonic::async_trait]
impl Critic for Service {
    async fn health(&self, _: Request<wire::Empty>) -> Result<Response<wire::Health>, Status> {
        Ok(Response::new(wire::Health {
            instance: self.instance,
            has_reward_model: self.has_reward_model,
        }))
    }

    async fn infer(
        &self,
        request: Request<wire::InferRequest>,
    ) -> Result<Response<wire::InferReply>, Status> {
        let sequences = wire::unsequences(request.into_inner().sequences);
        let out = self.run(move |w| w.infer(&sequences)).await?;
        Ok(Response::new((&out).into()))
    }

    async fn train(
        &self,
        request: Request<wire::TrainRequest>,
    ) -> Result<Response<wire::TrainReply>, Status> {
        let request: TrainRequest = request.into_inner().into();
        let out = self.run(move |w| w.train(&request)).await?;
        Ok(Response::new((&out).into()))
    }

    async fn save(&self, request: Request<wire::PathRequest>) -> Result<Response<wire::Empty>, Status> {
        let dir = PathBuf::from(request.into_inner().path);
        self.run(move |w| w.save(&dir)).await?;
        Ok(Response::new(wire::Empty {}))
    }

    async fn load(&self, request: Request<wire::PathRequest>) -> Result<Response<wire::Empty>, Status> {
        let dir = PathBuf::from(request.into_inner().path);
        self.run(move |w| w.load(&dir)).await?;
        Ok(Response::new(wire::Empty {}))
    }
}

/// Serves `worker` on `addr` until the process ends. `on_ready` gets the bound address (port 0
/// picks a free one).
pub fn serve(
    worker: CriticWorker,
    has_reward_model: bool,
    addr: SocketAddr,
    on_ready: impl FnOnce(SocketAddr),
) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| PpoError::Critic(format!("starting the server runtime: {e}")))?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| PpoError::Critic(format!("binding {addr}: {e}")))?;
        let bound = listener
            .local_addr()
            .map_err(|e| PpoError::Critic(format!("binding {addr}: {e}")))?;
        let instance = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            ^ ((std::process::id() as u64) << 32);
        let service = Service {
            worker: Arc::new(Mutex::new(worker)),
            instance,
            has_reward_model,
        };
        on_ready(bound);
        Server::builder()
            .add_service(
                CriticServer::new(service)
                    .max_decoding_message_size(MAX_MESSAGE)
                    .max_encoding_message_size(MAX_MESSAGE),
            )
            .serve_with_incoming(tokio_stream_from(listener))
            .await
            .map_err(|e| PpoError::Critic(format!("serving on {bound}: {e}")))
    })
}

fn tokio_stream_from(
    listener: tokio::net::TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    tokio_stream::wrappers::TcpListenerStream::new(listener)
}

type Call<R> = Arc<
    dyn Fn(GrpcClient<Channel>) -> Pin<Box<dyn Future<Output = Result<Response<R>, Status>> + Send>>
        + Send
        + Sync,
>;

/// A critic served by `aligner serve critic`.
pub struct RemoteCritic {
    runtime: tokio::runtime::Runtime,
    client: GrpcClient<Channel>,
    url: String,
    retry: Duration,
    instance: Arc<AtomicU64>,
    checkpoints: String,
}

impl RemoteCritic {
    /// Connects to `url` (waiting up to `retry_seconds` for the server to come up).
    /// `checkpoints` is named in the error if the server is lost.
    pub fn connect(url: &str, retry_seconds: f64, checkpoints: &Path) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| PpoError::Critic(format!("starting the client runtime: {e}")))?;
        let endpoint = Endpoint::from_shared(url.to_string())
            .map_err(|e| PpoError::Invalid(format!("ppo.critic_url = {url:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2));
        let channel = {
            let _guard = runtime.enter();
            endpoint.connect_lazy()
        };
        let client = GrpcClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        let this = Self {
            runtime,
            client,
            url: url.to_string(),
            retry: Duration::from_secs_f64(retry_seconds.max(0.0)),
            instance: Arc::new(AtomicU64::new(0)),
            checkpoints: checkpoints.display().to_string(),
        };
        let health = this
            .send(Arc::new(|mut c: GrpcClient<Channel>| {
                Box::pin(async move { c.health(wire::Empty {}).await })
            }))
            .wait()?;
        this.instance.store(health.instance, Ordering::SeqCst);
        tracing::info!(
            url,
            reward_model = health.has_reward_model,
            "connected to the critic server"
        );
        Ok(this)
    }

    fn send<R: Send + 'static>(&self, call: Call<R>) -> Ticket<R> {
        let (tx, ticket) = Ticket::channel();
        let client = self.client.clone();
        let (url, retry, checkpoints) = (self.url.clone(), self.retry, self.checkpoints.clone());
        let instance = self.instance.clone();
        self.runtime.spawn(async move {
            let started = Instant::now();
            let mut backoff = Duration::from_millis(100);
            let result = loop {
                match call(client.clone()).await {
                    Ok(reply) => break Ok(reply.into_inner()),
                    Err(status) if matches!(status.code(), Code::Unavailable | Code::Unknown | Code::Cancelled) => {
                        if started.elapsed() >= retry {
                            break Err(PpoError::CriticUnreachable {
                                url,
                                seconds: started.elapsed().as_secs_f64(),
                                last: status.message().to_string(),
                                checkpoints,
                            });
                        }
                        tracing::warn!(%url, error = status.message(), "critic unreachable; retrying in {backoff:?}");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                        let expected = instance.load(Ordering::SeqCst);
                        if let Ok(h) = client.clone().health(wire::Empty {}).await
                            && expected != 0
                            && h.get_ref().instance != expected
                        {
                            break Err(PpoError::Critic(format!(
                                "the critic server at {url} restarted and lost its state; \
                                 continue the run with --resume (checkpoints in {checkpoints})"
                            )));
                        }
                    }
                    Err(status) => break Err(PpoError::Critic(format!("{url}: {}", status.message()))),
                }
            };
            let _ = tx.send(result);
        });
        ticket
    }

    fn send_map<R: Send + 'static, T: Send + 'static>(&self, call: Call<R>, map: fn(R) -> T) -> Ticket<T> {
        let inner = self.send(call);
        let (tx, ticket) = Ticket::channel();
        self.runtime.spawn_blocking(move || {
            let _ = tx.send(inner.wait().map(map));
        });
        ticket
    }
}

impl CriticClient for RemoteCritic {
    fn infer(&self, sequences: Vec<Sequence>) -> Ticket<InferReply> {
        let request = wire::InferRequest {
            sequences: wire::sequences(&sequences),
        };
        self.send_map(
            Arc::new(move |mut c: GrpcClient<Channel>| {
                let r = request.clone();
                Box::pin(async move { c.infer(r).await })
            }),
            InferReply::from,
        )
    }

    fn train(&self, request: TrainRequest) -> Ticket<TrainReply> {
        let request = wire::TrainRequest::from(&request);
        self.send_map(
            Arc::new(move |mut c: GrpcClient<Channel>| {
                let r = request.clone();
                Box::pin(async move { c.train(r).await })
            }),
            TrainReply::from,
        )
    }

    fn save(&self, dir: PathBuf) -> Ticket<()> {
        let path = absolute(&dir);
        self.send_map(
            Arc::new(move |mut c: GrpcClient<Channel>| {
                let r = wire::PathRequest { path: path.clone() };
                Box::pin(async move { c.save(r).await })
            }),
            |_| (),
        )
    }

    fn load(&self, dir: PathBuf) -> Ticket<()> {
        let path = absolute(&dir);
        self.send_map(
            Arc::new(move |mut c: GrpcClient<Channel>| {
                let r = wire::PathRequest { path: path.clone() };
                Box::pin(async move { c.load(r).await })
            }),
            |_| (),
        )
    }
}

/// Paths go to the server as absolute paths (its working folder may differ).
fn absolute(dir: &Path) -> String {
    std::path::absolute(dir)
        .unwrap_or_else(|_| dir.to_path_buf())
        .display()
        .to_string()
}
