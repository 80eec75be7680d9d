//! The example's ledger (`PAYMENTS_LEDGER=postgres`): a row of table `payments` for every
//! payment it executes, in the database `DATABASE_URL` names. Without the transactional
//! mode each insert commits on its own, apart from the idempotency record: a process that
//! dies between the two leaves the row, and the retry adds another. With it
//! (`IDEMPOTENCY_TRANSACTIONAL=1`), the insert runs in the layer's transaction and commits
//! with the record, or not at all.

use axum::{extract::FromRequestParts, http::request::Parts};
use tower_idempotency::deadpool_postgres::tokio_postgres::{Config, NoTls};
use tower_idempotency::deadpool_postgres::{Manager, Pool, Runtime};
use tower_idempotency::transaction::PostgresTransaction;
#[cfg(feature = "sqlx")]
use tower_idempotency::transaction::SqlxTransaction;

/// The table, created at start when missing.
const CREATE: &str = "CREATE TABLE IF NOT EXISTS payments (
    id         TEXT        PRIMARY KEY,
    amount     BIGINT      NOT NULL,
    currency   TEXT        NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
)";

/// The advisory lock the instances creating the table take turns on.
const CREATE_LOCK: i64 = 0x7061_796d_656e_7473; // "payments"

/// Rows of `payments`, one per executed payment.
#[derive(Clone)]
pub struct Ledger {
    pool: Pool,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger").finish_non_exhaustive()
    }
}

impl Ledger {
    /// The ledger in the database at `url`, its table created if missing.
    pub async fn connect(url: &str) -> Result<Self, Box<dyn std::error::Error>> {
        let config: Config = url.parse()?;
        let pool = Pool::builder(Manager::new(config, NoTls))
            .max_size(16)
            .runtime(Runtime::Tokio1)
            .build()?;
        // Instances starting together take turns: two `CREATE TABLE IF NOT EXISTS` at once
        // can both try to create the table's type, and one fails.
        let mut client = pool.get().await?;
        let creating = client.transaction().await?;
        creating
            .batch_execute(&format!(
                "SELECT pg_advisory_xact_lock({CREATE_LOCK}); {CREATE}"
            ))
            .await?;
        creating.commit().await?;
        drop(client);
        Ok(Self { pool })
    }

    /// Records payment `id`: in the layer's transaction where there is one, else committed
    /// at once.
    pub async fn record(
        &self,
        transaction: &mut LayerTransaction,
        id: &str,
        amount: i64,
        currency: &str,
    ) -> Result<(), String> {
        let insert = "INSERT INTO payments (id, amount, currency) VALUES ($1, $2, $3)";
        match transaction {
            #[cfg(feature = "sqlx")]
            LayerTransaction::Sqlx(transaction) => {
                let inserted = tower_idempotency::sqlx::query(insert)
                    .bind(id)
                    .bind(amount)
                    .bind(currency)
                    .execute(&mut **transaction)
                    .await;
                return inserted.map(drop).map_err(|error| error.to_string());
            }
            LayerTransaction::TokioPostgres(transaction) => {
                let inserted = transaction
                    .execute(insert, &[&id, &amount, &currency])
                    .await;
                return inserted.map(drop).map_err(|error| error.to_string());
            }
            LayerTransaction::None => {}
        }
        let client = self.pool.get().await.map_err(|error| error.to_string())?;
        client
            .execute(insert, &[&id, &amount, &currency])
            .await
            .map_err(|error| error.to_string())?;
        Ok(())
    }
}

/// The layer's transaction, when the transactional mode hands one to the request: an sqlx
/// one (`IDEMPOTENCY_TRANSACTIONAL=1`, feature `sqlx`) or a tokio-postgres one
/// (`IDEMPOTENCY_TRANSACTIONAL=tokio-postgres`).
pub enum LayerTransaction {
    None,
    #[cfg(feature = "sqlx")]
    Sqlx(SqlxTransaction),
    TokioPostgres(PostgresTransaction),
}

impl<S: Send + Sync> FromRequestParts<S> for LayerTransaction {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        use axum::extract::OptionalFromRequestParts;
        #[cfg(feature = "sqlx")]
        {
            let sqlx =
                <SqlxTransaction as OptionalFromRequestParts<S>>::from_request_parts(parts, state);
            if let Ok(Some(transaction)) = sqlx.await {
                return Ok(Self::Sqlx(transaction));
            }
        }
        let tokio_postgres =
            <PostgresTransaction as OptionalFromRequestParts<S>>::from_request_parts(parts, state);
        Ok(match tokio_postgres.await {
            Ok(Some(transaction)) => Self::TokioPostgres(transaction),
            _ => Self::None,
        })
    }
}
