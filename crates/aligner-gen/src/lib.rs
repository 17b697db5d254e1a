//! aligner-gen
