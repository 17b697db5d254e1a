//! TensorBoard event files (`<run>/tb/events.out.tfevents.*`): every scalar a run logs, and
//! text summaries, readable by TensorBoard and `tensorboard.backend.event_processing`.
//!
//! The format is TensorFlow's: a file of records, each `u64` length, masked CRC-32C of the
//! length, the bytes of one `Event` protobuf, masked CRC-32C of the bytes. The few messages
//! needed are declared here with `prost`'s derive (field numbers from TensorFlow's
//! `event.proto`, `summary.proto` and `tensor.proto`), rather than generated from the .proto
//! files: that would need protoc and TensorFlow's sources at build time for six messages.

use std::io::Write;
use std::path::{Path, PathBuf};

use prost::Message;

use crate::error::{CoreError, Result};

/// TensorFlow's `Event`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
}

/// `Summary`: the values of one step.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `Summary.Value`: a scalar (`simple_value`) or a tensor with its plugin (text).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
    #[prost(message, optional, tag = "8")]
    pub tensor: Option<TensorProto>,
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
}

/// `SummaryMetadata`: which plugin draws the value.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
}

/// `SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PluginData {
    #[prost(string, tag = "1")]
    pub plugin_name: String,
}

/// `TensorProto`, only as the text plugin uses it: a string tensor.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorProto {
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShape>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// `TensorShapeProto`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorShape {
    #[prost(message, repeated, tag = "2")]
    pub dim: Vec<TensorDim>,
}

/// `TensorShapeProto.Dim`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorDim {
    #[prost(int64, tag = "1")]
    pub size: i64,
}

/// TensorFlow's `DT_STRING`.
const DT_STRING: i32 = 7;

/// The CRC TensorFlow's record format stores: CRC-32C, rotated and offset ("masked") so that a
/// CRC of data holding CRCs stays well distributed.
pub fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Appends events to one event file.
pub struct EventWriter {
    path: PathBuf,
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl EventWriter {
    /// A new event file in `dir` (created), opened with TensorBoard's version record. Each
    /// writer has a file of its own (a resumed run adds one), as TensorFlow's writers do.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| CoreError::cannot_write(dir, e))?;
        let wall = now();
        let mut n = 0;
        let path = loop {
            let candidate = dir.join(format!("events.out.tfevents.{}.aligner.{n}", wall as u64));
            if !candidate.exists() {
                break candidate;
            }
            n += 1;
        };
        let writer = Self { path };
        writer.append(&Event {
            wall_time: wall,
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        })?;
        Ok(writer)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the scalars and texts of `step` as one event.
    pub fn write_step(&self, step: i64, scalars: &[(&str, f64)], texts: &[(&str, &str)]) -> Result<()> {
        let mut value: Vec<SummaryValue> = scalars
            .iter()
            .map(|(tag, v)| SummaryValue {
                tag: tag.to_string(),
                simple_value: Some(*v as f32),
                ..Default::default()
            })
            .collect();
        value.extend(texts.iter().map(|(tag, text)| SummaryValue {
            tag: tag.to_string(),
            simple_value: None,
            tensor: Some(TensorProto {
                dtype: DT_STRING,
                tensor_shape: Some(TensorShape {
                    dim: vec![TensorDim { size: 1 }],
                }),
                string_val: vec![text.as_bytes().to_vec()],
            }),
            metadata: Some(SummaryMetadata {
                plugin_data: Some(PluginData {
                    plugin_name: "text".into(),
                }),
            }),
        }));
        self.append(&Event {
            wall_time: now(),
            step,
            file_version: None,
            summary: Some(Summary { value }),
        })
    }

    fn append(&self, event: &Event) -> Result<()> {
        let data = event.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&len);
        record.extend_from_slice(&masked_crc(&len).to_le_bytes());
        record.extend_from_slice(&data);
        record.extend_from_slice(&masked_crc(&data).to_le_bytes());
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .map_err(|e| CoreError::cannot_write(&self.path, e))?;
        file.write_all(&record)
            .and_then(|_| file.flush())
            .map_err(|e| CoreError::cannot_write(&self.path, e))
    }
}

/// Drops the summaries of steps after `step` from every event file in `dir` (a killed run's
/// steps past its checkpoint, which the resumed run logs again), each file rewritten through a
/// temporary name. A record cut short by the kill ends the file; a file that needs no change
/// is left as it is.
pub fn keep_through(dir: &Path, step: i64) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries {
        let path = entry.map_err(|e| CoreError::io(dir, e))?.path();
        let is_events = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("events.out.tfevents."));
        if !is_events {
            continue;
        }
        let bytes = std::fs::read(&path).map_err(|e| CoreError::io(&path, e))?;
        let records = records(&bytes);
        let whole = records.iter().map(|(_, raw)| raw.len()).sum::<usize>() == bytes.len();
        let kept: Vec<&[u8]> = records
            .iter()
            .filter(|(event, _)| event.summary.is_none() || event.step <= step)
            .map(|(_, raw)| *raw)
            .collect();
        if whole && kept.len() == records.len() {
            continue;
        }
        crate::checkpoint::write_atomic(&path, &kept.concat())?;
    }
    Ok(())
}

/// The intact records at the start of an event file: each decoded event with its raw bytes.
fn records(bytes: &[u8]) -> Vec<(Event, &[u8])> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(header) = bytes.get(at..at + 12) {
        let (len_bytes, len_crc) = header.split_at(8);
        if masked_crc(len_bytes).to_le_bytes() != len_crc {
            break;
        }
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes")) as usize;
        let (Some(data), Some(crc)) = (
            bytes.get(at + 12..at + 12 + len),
            bytes.get(at + 12 + len..at + 16 + len),
        ) else {
            break;
        };
        if masked_crc(data).to_le_bytes() != crc {
            break;
        }
        let Ok(event) = Event::decode(data) else { break };
        out.push((event, &bytes[at..at + 16 + len]));
        at += 16 + len;
    }
    out
}

/// Every event of an event file, each record's length and CRCs checked.
pub fn read_events(path: &Path) -> Result<Vec<Event>> {
    let bytes = std::fs::read(path).map_err(|e| CoreError::io(path, e))?;
    let bad =
        |at: usize, why: &str| CoreError::Invalid(format!("{}: record at byte {at}: {why}", path.display()));
    let mut events = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let header = bytes
            .get(at..at + 12)
            .ok_or_else(|| bad(at, "truncated header"))?;
        let (len_bytes, len_crc) = header.split_at(8);
        if masked_crc(len_bytes).to_le_bytes() != len_crc {
            return Err(bad(at, "length CRC does not match"));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes")) as usize;
        let data = bytes
            .get(at + 12..at + 12 + len)
            .ok_or_else(|| bad(at, "truncated data"))?;
        let crc = bytes
            .get(at + 12 + len..at + 16 + len)
            .ok_or_else(|| bad(at, "truncated data CRC"))?;
        if masked_crc(data).to_le_bytes() != crc {
            return Err(bad(at, "data CRC does not match"));
        }
        events.push(Event::decode(data).map_err(|e| bad(at, &e.to_string()))?);
        at += 16 + len;
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_matches_tensorflow() {
        // CRC-32C("123456789") = 0xE3069283 (the standard check value), then TensorFlow's mask.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(
            masked_crc(b"123456789"),
            0xE306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8)
        );
    }

    #[test]
    fn events_read_back_with_their_scalars_and_texts() {
        let dir = tempfile::tempdir().unwrap();
        let writer = EventWriter::create(dir.path()).unwrap();
        writer
            .write_step(3, &[("loss", 0.5), ("lr", 1e-4)], &[("samples", "Once upon")])
            .unwrap();
        let events = read_events(writer.path()).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        assert_eq!(events[1].step, 3);
        let values = &events[1].summary.as_ref().unwrap().value;
        assert_eq!(values[0].tag, "loss");
        assert_eq!(values[0].simple_value, Some(0.5));
        assert_eq!(values[1].simple_value, Some(1e-4));
        let text = values[2].tensor.as_ref().unwrap();
        assert_eq!(text.string_val, vec![b"Once upon".to_vec()]);
        assert_eq!(
            values[2]
                .metadata
                .as_ref()
                .unwrap()
                .plugin_data
                .as_ref()
                .unwrap()
                .plugin_name,
            "text"
        );
        // A flipped byte is caught by the CRC.
        let mut bytes = std::fs::read(writer.path()).unwrap();
        let last = bytes.len() - 6;
        bytes[last] ^= 1;
        std::fs::write(writer.path(), bytes).unwrap();
        assert!(
            read_events(writer.path())
                .unwrap_err()
                .to_string()
                .contains("CRC")
        );
    }

    #[test]
    fn a_resume_leaves_each_step_in_one_event_file() {
        let dir = tempfile::tempdir().unwrap();
        let killed = EventWriter::create(dir.path()).unwrap();
        for step in 1..=4 {
            killed.write_step(step, &[("loss", step as f64)], &[]).unwrap();
        }
        // The kill cut the last record short.
        let mut bytes = std::fs::read(killed.path()).unwrap();
        let head = bytes[..10].to_vec();
        bytes.extend_from_slice(&head);
        std::fs::write(killed.path(), bytes).unwrap();
        keep_through(dir.path(), 2).unwrap();
        let resumed = EventWriter::create(dir.path()).unwrap();
        for step in 3..=4 {
            resumed.write_step(step, &[("loss", step as f64)], &[]).unwrap();
        }
        let steps = |path: &Path| -> Vec<i64> {
            read_events(path)
                .unwrap()
                .iter()
                .filter(|e| e.summary.is_some())
                .map(|e| e.step)
                .collect()
        };
        assert_eq!(steps(killed.path()), [1, 2]);
        assert_eq!(steps(resumed.path()), [3, 4]);
        // Nothing left to drop: the files stay as they are.
        let before = std::fs::read(killed.path()).unwrap();
        keep_through(dir.path(), 4).unwrap();
        assert_eq!(std::fs::read(killed.path()).unwrap(), before);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }
}
