// The guides are Markdown files under `docs/guide/`, included here so that
// rustdoc shows them and `cargo test --doc` compiles their examples. Each
// module holds no items; a page about a feature is a module behind it, so its
// examples are compiled only where the feature is on.
#![doc = include_str!("../docs/guide/index.md")]

#[doc = include_str!("../docs/guide/modes.md")]
pub mod modes {}

#[doc = include_str!("../docs/guide/configuration.md")]
pub mod configuration {}

#[doc = include_str!("../docs/guide/stores.md")]
pub mod stores {}

#[doc = include_str!("../docs/guide/operations.md")]
pub mod operations {}

#[doc = include_str!("../docs/guide/fleet.md")]
pub mod fleet {}

#[doc = include_str!("../docs/guide/clients.md")]
pub mod clients {}

#[doc = include_str!("../docs/guide/limits.md")]
pub mod limits {}

#[doc = include_str!("../docs/guide/capacity.md")]
pub mod capacity {}
