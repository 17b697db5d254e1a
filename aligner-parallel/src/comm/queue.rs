//! Work handed out a chunk at a time, so ranks whose work comes out quicker take more of it.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::CommResult;

/// Chunks of `0..items`, each given to exactly one rank.
pub trait WorkQueue {
    /// The next chunk for this rank; `None` once every item has been handed out.
    fn next_chunk(&mut self) -> CommResult<Option<Range<usize>>>;
}

/// The queue of one process (and rank 0's own side of a shared queue).
#[derive(Debug, Clone)]
pub struct LocalQueue {
    next: Arc<AtomicUsize>,
    items: usize,
    chunk: usize,
}

impl LocalQueue {
    pub fn new(items: usize, chunk: usize) -> Self {
        Self {
            next: Arc::new(AtomicUsize::new(0)),
            items,
            chunk: chunk.max(1),
        }
    }

    /// Takes the next chunk (shared by every clone).
    pub fn take(&self) -> Option<Range<usize>> {
        let start = self.next.fetch_add(self.chunk, Ordering::SeqCst);
        (start < self.items).then(|| start..(start + self.chunk).min(self.items))
    }
}

impl WorkQueue for LocalQueue {
    fn next_chunk(&mut self) -> CommResult<Option<Range<usize>>> {
        Ok(self.take())
    }
}
