//! An environment served over HTTP: one JSON POST per batch of turns.
//!
//! Request body: `{"turns": [{"episode", "turn", "prompt", "response", "metadata"}, ...]}`; the
//! reply: `{"replies": [...]}` or a bare JSON array, one reply object per turn in order (as
//! [`super::CommandEnvironment`]'s lines, `episode` optional). A failed request, a reply that
//! is not JSON or has the wrong count ends the batch's episodes with the reason; one malformed
//! reply object ends only its episode.

use std::time::Duration;

use serde_json::Value;

use super::{Environment, Turn, TurnError, TurnResult, parse_reply, turn_json};
use crate::reward::shown;

/// `environment.url`: an environment endpoint.
pub struct HttpEnvironment {
    name: String,
    url: String,
    agent: ureq::Agent,
}

impl HttpEnvironment {
    pub fn new(name: impl Into<String>, url: impl Into<String>, timeout: Duration) -> Self {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .build()
            .into();
        Self {
            name: name.into(),
            url: url.into(),
            agent,
        }
    }

    fn exchange(&self, turns: &[Turn<'_>]) -> Result<Vec<Value>, String> {
        let body = serde_json::json!({"turns": turns.iter().map(turn_json).collect::<Vec<_>>()}).to_string();
        let mut reply = self
            .agent
            .post(&self.url)
            .header("Content-Type", "application/json")
            .send(&body)
            .map_err(|e| e.to_string())?;
        let text = reply.body_mut().read_to_string().map_err(|e| e.to_string())?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| format!("the reply {} is not JSON: {e}", shown(&text, 200)))?;
        let items = match value {
            Value::Array(items) => items,
            Value::Object(mut o) => match o.remove("replies") {
                Some(Value::Array(items)) => items,
                _ => {
                    return Err(format!(
                        "the reply {} has no \"replies\" array",
                        shown(&text, 200)
                    ));
                }
            },
            _ => {
                return Err(format!(
                    "the reply {} is neither an array nor {{\"replies\": [...]}}",
                    shown(&text, 200)
                ));
            }
        };
        if items.len() != turns.len() {
            return Err(format!("{} replies for {} turns", items.len(), turns.len()));
        }
        Ok(items)
    }
}

impl Environment for HttpEnvironment {
    fn name(&self) -> &str {
        &self.name
    }

    fn step(&self, turns: &[Turn<'_>]) -> Vec<TurnResult> {
        if turns.is_empty() {
            return Vec::new();
        }
        match self.exchange(turns) {
            Ok(items) => items.iter().map(parse_reply).collect(),
            Err(why) => {
                let error = TurnError::env(format!("environment {}: {why}", self.url));
                turns.iter().map(|_| Err(error.clone())).collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reward::http::tests::serve;
    use serde_json::Map;

    #[test]
    fn turns_go_out_as_one_post_and_bad_replies_end_their_episodes() {
        let (url, server) = serve(vec![
            (
                200,
                r#"{"replies": [{"observation": "a", "reward": 1.0}, {"observaton": "typo"}]}"#.into(),
            ),
            (200, r#"[{"done": true}]"#.into()),
        ]);
        let env = HttpEnvironment::new("http", url, Duration::from_secs(5));
        let metadata = Map::new();
        let turn = |episode| Turn {
            episode,
            turn: 0,
            prompt: "p",
            response: "r",
            metadata: &metadata,
        };
        let out = env.step(&[turn(1), turn(2)]);
        assert_eq!(out[0].clone().unwrap().observation.as_deref(), Some("a"));
        assert!(out[1].clone().unwrap_err().reason.contains("observaton"));
        // One reply for two turns: both episodes end, with the count.
        let out = env.step(&[turn(3), turn(4)]);
        assert!(
            out.iter()
                .all(|r| r.clone().unwrap_err().reason.contains("1 replies for 2 turns"))
        );
        let bodies = server.join().unwrap();
        let first: Value = serde_json::from_str(&bodies[0]).unwrap();
        assert_eq!(first["turns"][1]["episode"], 2);
    }
}
