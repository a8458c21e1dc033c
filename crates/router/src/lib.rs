//! Hybrid routing for calla: which requests may leave the machine, the circuit breaker that
//! sends eligible ones to a cloud upstream when the local engine is slow or unhealthy, the
//! upstream client, and the pre-flight probe with its runtime memory monitor.
//!
//! Policies are pure functions over plain data ([`policy::route`], [`breaker::next_state`],
//! [`breaker::trip_reason`], [`probe::fit`]); the server owns the clock and the I/O.

#![warn(missing_docs)]

pub mod breaker;
pub mod config;
pub mod policy;
pub mod probe;
pub mod upstream;

pub use breaker::{Admission, Breaker, BreakerConfig, BreakerState, TripReason};
pub use config::Config;
pub use policy::{LocalAvailability, Route, RouteInput};
pub use upstream::{CloudUpstream, UpstreamError};
