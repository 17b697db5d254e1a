//! Tool calls as an environment: the model's turn is parsed for a call, the tool runs, and
//! its output comes back as the next observation.
//!
//! A turn without a call ends the episode (the model has answered). A call names a tool
//! declared in the config ([`ToolSpec`]: a program, given `{"name", "arguments",
//! "metadata"}` (the prompt row's fields, for tools that serve a task's own data) as one JSON
//! line on stdin and answering on stdout, or an HTTP endpoint, POSTed the same) and is run
//! with the tool's timeout. An unknown tool, arguments that are not a JSON object or miss
//! a `required` key of the tool's schema, a crash, a non-zero exit or a hang end that episode
//! with the reason, counted as a tool error.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use regex::Regex;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{Environment, Reply, Turn, TurnError, TurnResult};
use crate::reward::shown;

/// One tool the model may call (`[[environment.tools]]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSpec {
    pub name: String,
    /// What the tool does (rendered for the model with the schema).
    #[serde(default)]
    pub description: String,
    /// The arguments' JSON schema (`{"type": "object", "properties": ..., "required": [...]}`).
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub parameters: Value,
    /// The program that runs one call: the arguments on stdin, the result on stdout.
    #[serde(default)]
    pub command: Vec<String>,
    /// Or an endpoint POSTed the arguments; the reply's body (or its `result`) is the result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// How long one call may take.
    #[serde(default = "default_tool_timeout")]
    pub timeout_seconds: f64,
}

fn default_tool_timeout() -> f64 {
    10.0
}

/// How a call is written in the model's turn.
#[derive(Debug, Clone)]
pub enum ToolCallFormat {
    /// Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
    Hermes,
    /// A regex with the named groups `name` (optional when one tool is declared) and
    /// `arguments` (a JSON object, or any text, passed as `{"input": text}`).
    Regex(Regex),
}

/// A parsed call: the tool's name and its arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Map<String, Value>,
}

/// The first call in `text`, if any; `Err` for a call that cannot be read.
pub fn parse_tool_call(
    text: &str,
    format: &ToolCallFormat,
    tools: &[ToolSpec],
) -> Result<Option<ToolCall>, String> {
    match format {
        ToolCallFormat::Hermes => {
            let Some(start) = text.find("<tool_call>") else {
                return Ok(None);
            };
            let body = &text[start + "<tool_call>".len()..];
            let body = body.split("</tool_call>").next().unwrap_or(body).trim();
            let value: Value = serde_json::from_str(body)
                .map_err(|e| format!("the tool call {} is not JSON: {e}", shown(body, 200)))?;
            let name = value
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("the tool call {} names no tool (\"name\")", shown(body, 200)))?;
            let arguments = match value.get("arguments") {
                None | Some(Value::Null) => Map::new(),
                Some(Value::Object(a)) => a.clone(),
                Some(other) => {
                    return Err(format!(
                        "the arguments {} of a call to `{name}` are not a JSON object",
                        shown(&other.to_string(), 200)
                    ));
                }
            };
            Ok(Some(ToolCall {
                name: name.to_string(),
                arguments,
            }))
        }
        ToolCallFormat::Regex(re) => {
            let Some(caps) = re.captures(text) else {
                return Ok(None);
            };
            let name = match (caps.name("name"), tools) {
                (Some(n), _) => n.as_str().to_string(),
                (None, [only]) => only.name.clone(),
                (None, _) => {
                    return Err(
                        "the tool call regex has no `name` group and several tools are declared".into(),
                    );
                }
            };
            let arguments = match caps.name("arguments").map(|a| a.as_str().trim()) {
                None | Some("") => Map::new(),
                Some(raw) => match serde_json::from_str::<Value>(raw) {
                    Ok(Value::Object(a)) => a,
                    _ => Map::from_iter([("input".to_string(), Value::String(raw.to_string()))]),
                },
            };
            Ok(Some(ToolCall { name, arguments }))
        }
    }
}

/// `tools` as the OpenAI-style list chat templates take as `tools`.
pub fn tools_json(tools: &[ToolSpec]) -> Value {
    Value::Array(
        tools
            .iter()
            .map(|t| {
                serde_json::json!({"type": "function", "function": {
                    "name": t.name, "description": t.description, "parameters": t.parameters}})
            })
            .collect(),
    )
}

/// `[environment]` with `tools`: the model calls tools until it answers without one.
pub struct ToolEnvironment {
    tools: Vec<ToolSpec>,
    format: ToolCallFormat,
    /// The observation after a call; `{name}` and `{result}` are replaced.
    observation_template: String,
    agent: ureq::Agent,
}

impl ToolEnvironment {
    pub fn new(
        tools: Vec<ToolSpec>,
        format: ToolCallFormat,
        observation_template: impl Into<String>,
    ) -> Self {
        Self {
            tools,
            format,
            observation_template: observation_template.into(),
            agent: ureq::Agent::config_builder().build().into(),
        }
    }

    /// Runs one call; the tool's output or why it failed.
    fn call(&self, call: &ToolCall, metadata: &Map<String, Value>) -> Result<String, String> {
        let tool = self.tools.iter().find(|t| t.name == call.name).ok_or_else(|| {
            let known: Vec<&str> = self.tools.iter().map(|t| t.name.as_str()).collect();
            format!("unknown tool `{}` (declared: {})", call.name, known.join(", "))
        })?;
        if let Some(required) = tool.parameters.get("required").and_then(Value::as_array) {
            for key in required.iter().filter_map(Value::as_str) {
                if !call.arguments.contains_key(key) {
                    return Err(format!(
                        "the call to `{}` misses its required argument `{key}`",
                        tool.name
                    ));
                }
            }
        }
        let input = serde_json::json!({
            "name": call.name,
            "arguments": call.arguments,
            "metadata": metadata,
        })
        .to_string();
        let timeout = Duration::from_secs_f64(tool.timeout_seconds.max(0.0));
        let output = match (&tool.url, tool.command.as_slice()) {
            (Some(url), _) => self.post(url, &input, timeout),
            (None, [program, args @ ..]) => run_program(program, args, &input, timeout),
            (None, []) => Err("the tool declares neither a command nor a url".into()),
        };
        output.map_err(|why| format!("tool `{}`: {why}", tool.name))
    }

    fn post(&self, url: &str, input: &str, timeout: Duration) -> Result<String, String> {
        let mut reply = self
            .agent
            .post(url)
            .config()
            .timeout_global(Some(timeout))
            .build()
            .header("Content-Type", "application/json")
            .send(input)
            .map_err(|e| e.to_string())?;
        let text = reply.body_mut().read_to_string().map_err(|e| e.to_string())?;
        Ok(match serde_json::from_str::<Value>(&text) {
            Ok(Value::Object(o)) if o.contains_key("result") => match &o["result"] {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            },
            _ => text,
        })
    }
}

/// Runs `program args` with `input` on stdin; its stdout (trimmed) or why it failed.
fn run_program(program: &str, args: &[String], input: &str, timeout: Duration) -> Result<String, String> {
    let mut child =
        crate::process::spawn_piped(program, args).map_err(|e| format!("cannot start `{program}`: {e}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        // A tool that does not read its input may have exited already.
        let _ = stdin
            .write_all(input.as_bytes())
            .and_then(|()| stdin.write_all(b"\n"));
    }
    let read = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut out = String::new();
            let _ = pipe.read_to_string(&mut out);
            out
        })
    };
    let stdout = child.stdout.take().map(|p| read(Box::new(p)));
    let stderr = child.stderr.take().map(|p| read(Box::new(p)));
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "no answer within {:.1} s (timeout_seconds); killed",
                    timeout.as_secs_f64()
                ));
            }
            Err(e) => return Err(format!("waiting for it failed: {e}")),
        }
    };
    let out = stdout.and_then(|h| h.join().ok()).unwrap_or_default();
    let err = stderr.and_then(|h| h.join().ok()).unwrap_or_default();
    if !status.success() {
        return Err(format!(
            "exited with {status}; its stderr: {}",
            shown(err.trim(), 300)
        ));
    }
    Ok(out.trim().to_string())
}

impl Environment for ToolEnvironment {
    fn name(&self) -> &str {
        "tools"
    }

    fn step(&self, turns: &[Turn<'_>]) -> Vec<TurnResult> {
        // Each turn's call runs on a thread of its own: one slow tool does not hold up the
        // others of the batch.
        std::thread::scope(|scope| {
            let handles: Vec<_> = turns
                .iter()
                .map(|turn| {
                    scope.spawn(move || -> TurnResult {
                        let call = parse_tool_call(turn.response, &self.format, &self.tools)
                            .map_err(TurnError::tool)?;
                        let Some(call) = call else {
                            return Ok(Reply {
                                done: true,
                                ..Reply::default()
                            });
                        };
                        let result = self.call(&call, turn.metadata).map_err(TurnError::tool)?;
                        Ok(Reply {
                            observation: Some(
                                self.observation_template
                                    .replace("{name}", &call.name)
                                    .replace("{result}", &result),
                            ),
                            reward: None,
                            done: false,
                            tool_calls: 1,
                        })
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(TurnError::tool("the tool call's thread panicked")))
                })
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn python_tool(name: &str, script: &str, timeout: f64) -> ToolSpec {
        ToolSpec {
            name: name.into(),
            description: String::new(),
            parameters: serde_json::json!({"type": "object", "required": ["word"]}),
            command: vec!["python3".into(), "-c".into(), script.into()],
            url: None,
            timeout_seconds: timeout,
        }
    }

    /// The declared tools as templates take them, from `[environment]`.
    #[test]
    fn tools_reach_chat_templates_in_the_openai_form() {
        let section = super::super::EnvironmentSection {
            tools: vec![python_tool("lookup", "", 1.0)],
            ..Default::default()
        };
        let tools = section.tools_json().unwrap();
        assert_eq!(tools[0]["type"], "function");
        assert_eq!(tools[0]["function"]["name"], "lookup");
        assert_eq!(tools[0]["function"]["parameters"]["required"][0], "word");
        assert!(super::super::EnvironmentSection::default().tools_json().is_none());
    }

    /// An observation template with a placeholder it does not fill, or without the result,
    /// and an empty stop string (which ends every turn at once) are refused naming the key.
    #[test]
    fn tool_settings_that_would_mislead_the_model_are_refused() {
        let section = |template: &str, stops: &[&str]| super::super::EnvironmentSection {
            tools: vec![python_tool("lookup", "", 1.0)],
            observation_template: template.into(),
            stop_strings: stops.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        let refused = |s: super::super::EnvironmentSection| s.build().err().map(|e| e.to_string());
        assert!(
            section(" The word was {result} ({name}).", &[" look"])
                .build()
                .is_ok()
        );
        let unknown = refused(section(" The word was {word}: {result}.", &[])).unwrap();
        assert!(
            unknown.contains("environment.observation_template") && unknown.contains("{word}"),
            "{unknown}"
        );
        let missing = refused(section(" Nothing.", &[])).unwrap();
        assert!(missing.contains("{result}"), "{missing}");
        let empty = refused(section("{result}", &[" look", ""])).unwrap();
        assert!(empty.contains("environment.stop_strings"), "{empty}");
    }

    #[test]
    fn hermes_and_regex_calls_parse() {
        let tools = [python_tool("lookup", "", 1.0)];
        let call = parse_tool_call(
            r#"Let me check. <tool_call>{"name": "lookup", "arguments": {"word": "cat"}}</tool_call>"#,
            &ToolCallFormat::Hermes,
            &tools,
        )
        .unwrap()
        .unwrap();
        assert_eq!(call.name, "lookup");
        assert_eq!(call.arguments["word"], "cat");
        assert_eq!(
            parse_tool_call("no call", &ToolCallFormat::Hermes, &tools),
            Ok(None)
        );
        assert!(
            parse_tool_call("<tool_call>{oops", &ToolCallFormat::Hermes, &tools)
                .unwrap_err()
                .contains("not JSON")
        );
        let re = ToolCallFormat::Regex(Regex::new(r"\[(?P<arguments>\w+)\]").unwrap());
        let call = parse_tool_call("she found a [key] there", &re, &tools)
            .unwrap()
            .unwrap();
        assert_eq!(
            (call.name.as_str(), &call.arguments["input"]),
            ("lookup", &Value::from("key"))
        );
    }

    #[test]
    fn tools_run_and_their_failures_end_only_their_episode() {
        let tools = vec![
            python_tool(
                "lookup",
                "import json,sys; a=json.loads(sys.stdin.readline()); print(a['arguments']['word'].upper())",
                5.0,
            ),
            python_tool(
                "crash",
                "import sys; sys.stderr.write('tool broke'); sys.exit(2)",
                5.0,
            ),
            python_tool("hang", "import time; time.sleep(30)", 0.3),
        ];
        let env = ToolEnvironment::new(
            tools,
            ToolCallFormat::Hermes,
            "<tool_response>{name}: {result}</tool_response>",
        );
        let metadata = Map::new();
        let calls = [
            r#"<tool_call>{"name": "lookup", "arguments": {"word": "cat"}}</tool_call>"#,
            r#"<tool_call>{"name": "crash", "arguments": {"word": "x"}}</tool_call>"#,
            r#"<tool_call>{"name": "hang", "arguments": {"word": "x"}}</tool_call>"#,
            r#"<tool_call>{"name": "search", "arguments": {}}</tool_call>"#,
            r#"<tool_call>{"name": "lookup", "arguments": {}}</tool_call>"#,
            "The end.",
        ];
        let turns: Vec<Turn<'_>> = calls
            .iter()
            .enumerate()
            .map(|(i, response)| Turn {
                episode: i as u64,
                turn: 0,
                prompt: "p",
                response,
                metadata: &metadata,
            })
            .collect();
        let out = env.step(&turns);
        let ok = out[0].clone().unwrap();
        assert_eq!(
            ok.observation.as_deref(),
            Some("<tool_response>lookup: CAT</tool_response>")
        );
        assert_eq!((ok.tool_calls, ok.done), (1, false));
        let why = |i: usize| {
            let e = out[i].clone().unwrap_err();
            assert!(e.tool);
            e.reason
        };
        assert!(why(1).contains("tool broke"), "{}", why(1));
        assert!(why(2).contains("within 0.3 s"), "{}", why(2));
        assert!(why(3).contains("unknown tool `search`"), "{}", why(3));
        assert!(why(4).contains("required argument `word`"), "{}", why(4));
        assert!(out[5].clone().unwrap().done);
    }
}
