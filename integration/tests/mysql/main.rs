//! `MySqlStore` on MySQL/MariaDB, one module per subject in one binary
//! (`cargo test -p integration --features mysql --test mysql`): the store
//! against the server (`store`), faults (`faults`: connections killed,
//! locks held), the max hold (`max_hold`), and two ledger processes on one
//! database (`fleet`). Each test works on tables of its own (or a ledger
//! database of its own), so modules run side by side.

#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "../../../tests/common/ledger_driver.rs"]
mod driver;
#[path = "../../../tests/fleet_support/mod.rs"]
mod fleet_support;

mod faults;
mod fleet;
mod max_hold;
mod store;
