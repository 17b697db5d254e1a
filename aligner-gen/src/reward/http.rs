//! A reward served over HTTP: one JSON POST per batch, retried with exponential back-off.
//!
//! Request body: `{"requests": [<RewardInput::to_json()>, ...]}`; the reply: `{"scores": [...]}`
//! or a bare JSON array, one number (or `{"score": x}`) per request, in order.

use std::time::Duration;

use serde_json::Value;

use super::{Reward, RewardError, RewardInput, parse_score, shown};

/// `reward.url`: a scoring endpoint.
pub struct HttpReward {
    name: String,
    url: String,
    agent: ureq::Agent,
    /// Attempts after the first before the error stands.
    retries: usize,
    /// The wait before the first retry; doubled for each next one.
    backoff: Duration,
}

impl HttpReward {
    pub fn new(name: impl Into<String>, url: impl Into<String>, timeout: Duration, retries: usize) -> Self {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .build()
            .into();
        Self {
            name: name.into(),
            url: url.into(),
            agent,
            retries,
            backoff: Duration::from_millis(500),
        }
    }

    /// The first wait between attempts (doubled each time; tests shorten it).
    pub fn with_backoff(mut self, backoff: Duration) -> Self {
        self.backoff = backoff;
        self
    }

    fn attempt(&self, body: &str, expected: usize) -> Result<Vec<f64>, String> {
        let mut reply = self
            .agent
            .post(&self.url)
            .header("Content-Type", "application/json")
            .send(body)
            .map_err(|e| e.to_string())?;
        let text = reply.body_mut().read_to_string().map_err(|e| e.to_string())?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| format!("the reply {} is not JSON: {e}", shown(&text, 200)))?;
        let items = match &value {
            Value::Array(items) => Some(items),
            Value::Object(o) => o.get("scores").and_then(Value::as_array),
            _ => None,
        }
        .ok_or_else(|| {
            format!(
                "the reply {} is neither a JSON array nor {{\"scores\": [...]}}",
                shown(&text, 200)
            )
        })?;
        if items.len() != expected {
            return Err(format!("{} scores for {expected} requests", items.len()));
        }
        items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                parse_score(v)
                    .ok_or_else(|| format!("score {i} is {}, not a finite number", shown(&v.to_string(), 80)))
            })
            .collect()
    }
}

impl Reward for HttpReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, batch: &[RewardInput<'_>]) -> Result<Vec<f64>, RewardError> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let requests: Vec<Value> = batch.iter().map(RewardInput::to_json).collect();
        let body = serde_json::json!({ "requests": requests }).to_string();
        let mut wait = self.backoff;
        let mut last = String::new();
        for attempt in 0..=self.retries {
            match self.attempt(&body, batch.len()) {
                Ok(scores) => return Ok(scores),
                Err(why) => last = why,
            }
            if attempt < self.retries {
                tracing::warn!(reward = %self.name, url = %self.url, attempt = attempt + 1, "{last}; retrying in {wait:?}");
                std::thread::sleep(wait);
                wait *= 2;
            }
        }
        Err(RewardError::new(
            &self.name,
            format!(
                "POST {} failed after {} attempts: {last}",
                self.url,
                self.retries + 1
            ),
        ))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::reward::tests::inputs;
    use serde_json::Map;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;

    /// A one-thread HTTP server on loopback answering each request with the next of `replies`
    /// (status, body), and handing the request bodies back through the join handle.
    pub(crate) fn serve(replies: Vec<(u16, String)>) -> (String, std::thread::JoinHandle<Vec<String>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/score", listener.local_addr().unwrap());
        let handle = std::thread::spawn(move || {
            let mut bodies = Vec::new();
            for (status, reply) in replies {
                let (stream, _) = listener.accept().unwrap();
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut length = 0;
                loop {
                    let mut line = String::new();
                    reader.read_line(&mut line).unwrap();
                    if line == "\r\n" || line.is_empty() {
                        break;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                }
                let mut body = vec![0; length];
                reader.read_exact(&mut body).unwrap();
                bodies.push(String::from_utf8(body).unwrap());
                let mut stream = stream;
                write!(
                    stream,
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}",
                    reply.len()
                )
                .unwrap();
            }
            bodies
        });
        (url, handle)
    }

    #[test]
    fn scores_come_back_in_order_after_a_retried_failure() {
        let (url, server) = serve(vec![
            (503, "{}".into()),
            (200, r#"{"scores": [1.5, {"score": -1}]}"#.into()),
        ]);
        let reward =
            HttpReward::new("judge", url, Duration::from_secs(10), 2).with_backoff(Duration::from_millis(10));
        let mut fields = Map::new();
        fields.insert("answer".into(), "42".into());
        assert_eq!(
            reward.score(&inputs(&["a", "b"], &fields)).unwrap(),
            vec![1.5, -1.0]
        );
        let bodies = server.join().unwrap();
        let sent: Value = serde_json::from_str(&bodies[1]).unwrap();
        assert_eq!(sent["requests"][1]["response"], "b");
        assert_eq!(sent["requests"][0]["metadata"]["answer"], "42");
    }

    #[test]
    fn an_endpoint_that_keeps_failing_or_answers_garbage_is_an_error() {
        let (url, server) = serve(vec![(500, "{}".into()), (500, "{}".into())]);
        let reward = HttpReward::new("judge", &url, Duration::from_secs(10), 1)
            .with_backoff(Duration::from_millis(10));
        let e = reward
            .score(&inputs(&["a"], &Map::new()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"judge\"") && e.contains("after 2 attempts") && e.contains("500"),
            "{e}"
        );
        server.join().unwrap();
        let (url, server) = serve(vec![(200, r#"{"scores": ["great"]}"#.into())]);
        let e = HttpReward::new("judge", &url, Duration::from_secs(10), 0)
            .score(&inputs(&["a"], &Map::new()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a finite number"), "{e}");
        server.join().unwrap();
    }
}
