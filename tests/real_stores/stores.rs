//! The stores and modes the harness runs, and what differs per store: a
//! fresh database, the ledger's flags, how its connections are cut, how an
//! outside transaction holds what a credit needs, and where the credits
//! are read back.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::{Connection, Executor};
use tokio::runtime::Runtime;
use tower_idempotency_sqlx::sqlx;

#[path = "../common/services.rs"]
#[allow(dead_code)]
mod services;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    /// `SqliteStore` (rusqlite) and the ledger's tables in one file.
    Sqlite,
    /// `SqlxSqliteStore`: one sqlx pool for the ledger and its records.
    SqlxSqlite,
    /// `PostgresStore` (tokio-postgres).
    Postgres,
    /// `SqlxPostgresStore`.
    SqlxPostgres,
    /// `SqlxMySqlStore` on MariaDB.
    Mysql,
    /// `RedisStore` for the records, the ledger's tables in SQLite.
    Redis,
}

pub struct Config {
    pub store: Store,
    pub mode: &'static str,
}

/// Every store, in each mode it supports.
pub const CONFIGS: [Config; 10] = [
    Config {
        store: Store::Sqlite,
        mode: "transactional",
    },
    Config {
        store: Store::Sqlite,
        mode: "separate",
    },
    Config {
        store: Store::SqlxSqlite,
        mode: "transactional",
    },
    Config {
        store: Store::Postgres,
        mode: "transactional",
    },
    Config {
        store: Store::Postgres,
        mode: "separate",
    },
    Config {
        store: Store::SqlxPostgres,
        mode: "transactional",
    },
    Config {
        store: Store::SqlxPostgres,
        mode: "separate",
    },
    Config {
        store: Store::Mysql,
        mode: "transactional",
    },
    Config {
        store: Store::Mysql,
        mode: "separate",
    },
    Config {
        store: Store::Redis,
        mode: "separate",
    },
];

impl Config {
    /// `store/mode`, as `REAL_STORES` names it.
    pub fn name(&self) -> String {
        format!("{}/{}", self.store.name(), self.mode)
    }

    /// Whether `names` (store or store/mode) pick this configuration.
    pub fn matches(&self, names: &[&str]) -> bool {
        names
            .iter()
            .any(|n| *n == self.store.name() || *n == self.name())
    }
}

impl Store {
    pub fn name(self) -> &'static str {
        match self {
            Store::Sqlite => "sqlite",
            Store::SqlxSqlite => "sqlx-sqlite",
            Store::Postgres => "postgres",
            Store::SqlxPostgres => "sqlx-postgres",
            Store::Mysql => "mysql",
            Store::Redis => "redis",
        }
    }

    /// Whether the ledger's tables live in a SQLite file.
    pub fn sqlite_file(self) -> bool {
        matches!(self, Store::Sqlite | Store::SqlxSqlite | Store::Redis)
    }

    /// Whether the database has connections the harness can cut.
    pub fn cuts(self) -> bool {
        !matches!(self, Store::Sqlite | Store::SqlxSqlite)
    }
}

/// One run's database.
pub struct Db {
    store: Store,
    /// `--db`: a SQLite path or a server URL.
    pub arg: PathBuf,
    /// The database's name on its server (or the Redis scope's prefix).
    name: String,
    /// More ledger flags (`--db-driver`, `--key-store`).
    pub flags: Vec<String>,
}

impl Db {
    /// A fresh, empty database for the run `name` (letters, digits, `_`).
    pub fn fresh(rt: &Runtime, store: Store, name: &str, dir: &Path) -> Db {
        let file = dir.join(format!("{name}.sqlite3"));
        let (arg, flags) = match store {
            Store::Sqlite => (file, vec![]),
            Store::SqlxSqlite => (file, vec!["--db-driver", "sqlx"]),
            Store::Redis => (file, vec!["--key-store", "redis"]),
            Store::Postgres | Store::SqlxPostgres => {
                let url = services::postgres_url();
                let drop = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
                let create = format!("CREATE DATABASE {name}");
                rt.block_on(run_on::<sqlx::PgConnection>(&url, [drop, create]));
                let driver = if store == Store::SqlxPostgres {
                    vec!["--db-driver", "sqlx"]
                } else {
                    vec![]
                };
                (PathBuf::from(on_server(&url, name)), driver)
            }
            Store::Mysql => {
                let url = services::mysql_url();
                let drop = format!("DROP DATABASE IF EXISTS {name}");
                let create = format!("CREATE DATABASE {name}");
                rt.block_on(run_on::<sqlx::MySqlConnection>(&url, [drop, create]));
                (
                    PathBuf::from(on_server(&url, name)),
                    vec!["--db-driver", "sqlx"],
                )
            }
        };
        let mut flags: Vec<String> = flags.into_iter().map(String::from).collect();
        if let Some(at) = flags.iter().position(|f| f == "redis") {
            flags[at] = services::redis_url();
        }
        Db {
            store,
            arg,
            name: name.to_owned(),
            flags,
        }
    }

    /// Drops the run's database from its server (its SQLite file goes with
    /// the run's directory).
    pub async fn remove(&self) {
        let drop = format!("DROP DATABASE IF EXISTS {}", self.name);
        match self.store {
            Store::Postgres | Store::SqlxPostgres => {
                let url = services::postgres_url();
                let drop = format!("{drop} WITH (FORCE)");
                run_on::<sqlx::PgConnection>(&url, [drop]).await;
            }
            Store::Mysql => run_on::<sqlx::MySqlConnection>(&services::mysql_url(), [drop]).await,
            Store::Sqlite | Store::SqlxSqlite | Store::Redis => {}
        }
    }

    /// Cuts every connection the ledgers hold to the database's server
    /// (PostgreSQL's `pg_terminate_backend`, MariaDB's `KILL`, Redis's
    /// `CLIENT KILL`); each is reconnected by its pool.
    pub async fn cut(&self) {
        match self.store {
            Store::Postgres | Store::SqlxPostgres => {
                let Ok(mut admin) = sqlx::PgConnection::connect(&services::postgres_url()).await
                else {
                    return;
                };
                let _ = sqlx::query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                     WHERE datname = $1 AND pid <> pg_backend_pid()",
                )
                .bind(&self.name)
                .execute(&mut admin)
                .await;
            }
            Store::Mysql => {
                let Ok(mut admin) = sqlx::MySqlConnection::connect(&services::mysql_url()).await
                else {
                    return;
                };
                let ids: Vec<(u64,)> = sqlx::query_as(
                    "SELECT id FROM information_schema.processlist
                     WHERE db = ? AND id <> CONNECTION_ID()",
                )
                .bind(&self.name)
                .fetch_all(&mut admin)
                .await
                .unwrap_or_default();
                for (id,) in ids {
                    let _ = admin
                        .execute(sqlx::AssertSqlSafe(format!("KILL CONNECTION {id}")))
                        .await;
                }
            }
            Store::Redis => {
                let Ok(client) = redis::Client::open(services::redis_url()) else {
                    return;
                };
                if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
                    let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
                        .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"])
                        .query_async(&mut conn)
                        .await;
                }
            }
            Store::Sqlite | Store::SqlxSqlite => {
                unreachable!("a SQLite file has no connections to cut")
            }
        }
    }

    /// Holds, from an outside transaction, what every credit of `account`
    /// needs for `hold`: the account's row (`SELECT ... FOR UPDATE`), or
    /// SQLite's write lock (`BEGIN IMMEDIATE`).
    pub async fn hold(&self, account: i64, hold: Duration) {
        if self.store.sqlite_file() {
            let path = self.arg.clone();
            let _ = tokio::task::spawn_blocking(move || {
                let mut conn = rusqlite::Connection::open(path).expect("open the ledger's file");
                conn.busy_timeout(Duration::from_secs(30)).unwrap();
                let tx = conn
                    .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                    .expect("the write lock");
                std::thread::sleep(hold);
                drop(tx);
            })
            .await;
            return;
        }
        let lock = "SELECT id FROM accounts WHERE id = ? FOR UPDATE";
        if self.store == Store::Mysql {
            let mut conn = sqlx::MySqlConnection::connect(&self.url())
                .await
                .expect("MariaDB");
            let mut tx = conn.begin().await.unwrap();
            sqlx::query(lock)
                .bind(account)
                .execute(&mut *tx)
                .await
                .unwrap();
            tokio::time::sleep(hold).await;
            let _ = tx.rollback().await;
        } else {
            let mut conn = sqlx::PgConnection::connect(&self.url())
                .await
                .expect("PostgreSQL");
            let mut tx = conn.begin().await.unwrap();
            let lock = lock.replace('?', "$1");
            sqlx::query(sqlx::AssertSqlSafe(lock))
                .bind(account)
                .execute(&mut *tx)
                .await
                .unwrap();
            tokio::time::sleep(hold).await;
            let _ = tx.rollback().await;
        }
    }

    /// The credits of `account`: `(credit id, amount)`, and its balance.
    pub async fn credits(&self, account: i64) -> (Vec<(i64, i64)>, i64) {
        let credits = "SELECT id, amount FROM credits WHERE account_id = ? ORDER BY id";
        let balance = "SELECT balance FROM accounts WHERE id = ?";
        if self.store.sqlite_file() {
            let conn = rusqlite::Connection::open(&self.arg).expect("open the ledger's file");
            let mut stmt = conn.prepare(credits).unwrap();
            let rows = stmt
                .query_map([account], |r| Ok((r.get(0)?, r.get(1)?)))
                .unwrap();
            let rows = rows.collect::<Result<_, _>>().unwrap();
            let balance = conn.query_row(balance, [account], |r| r.get(0)).unwrap();
            return (rows, balance);
        }
        if self.store == Store::Mysql {
            let mut conn = sqlx::MySqlConnection::connect(&self.url())
                .await
                .expect("MariaDB");
            let rows = sqlx::query_as(credits)
                .bind(account)
                .fetch_all(&mut conn)
                .await
                .unwrap();
            let (balance,) = sqlx::query_as(balance)
                .bind(account)
                .fetch_one(&mut conn)
                .await
                .unwrap();
            (rows, balance)
        } else {
            let mut conn = sqlx::PgConnection::connect(&self.url())
                .await
                .expect("PostgreSQL");
            let credits = sqlx::AssertSqlSafe(credits.replace('?', "$1"));
            let rows = sqlx::query_as(credits)
                .bind(account)
                .fetch_all(&mut conn)
                .await
                .unwrap();
            let balance = sqlx::AssertSqlSafe(balance.replace('?', "$1"));
            let (balance,) = sqlx::query_as(balance)
                .bind(account)
                .fetch_one(&mut conn)
                .await
                .unwrap();
            (rows, balance)
        }
    }

    fn url(&self) -> String {
        self.arg.to_string_lossy().into_owned()
    }
}

/// Runs `statements` on the server of `url`, one after the other.
async fn run_on<C>(url: &str, statements: impl IntoIterator<Item = String>)
where
    C: Connection,
    for<'c> &'c mut C: Executor<'c, Database = C::Database>,
{
    let mut admin = C::connect(url)
        .await
        .expect("connect to the database server");
    for statement in statements {
        let statement = sqlx::AssertSqlSafe(statement);
        admin
            .execute(statement)
            .await
            .expect("create or drop the run's database");
    }
}

/// `url` with its database replaced by `name`.
fn on_server(url: &str, name: &str) -> String {
    let (server, _) = url.rsplit_once('/').expect("a database in the URL");
    format!("{server}/{name}")
}
