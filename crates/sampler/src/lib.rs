//! placeholder until the crate is written
