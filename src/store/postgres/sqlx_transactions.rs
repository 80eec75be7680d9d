//! The transactional mode on an sqlx pool.

use async_trait::async_trait;
use sqlx::{postgres::PgRow, PgPool, Postgres, Row};

use super::{
    transactional::{within_begin_timeout, Begun, Claiming, Driver},
    Completion, PostgresStoreError,
};
use crate::store::{Error, Result};

/// Transactions on connections of an sqlx pool.
pub(super) struct Sqlx {
    pool: PgPool,
}

impl Sqlx {
    pub(super) fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    /// A transaction on a pooled connection. A connection the server ended while it sat in
    /// the pool (a restart, `pg_terminate_backend`, a timeout) fails its `BEGIN` having done
    /// nothing, and sqlx discards it: the next is tried, up to every connection the pool
    /// holds and one it opens. So a pool that skips sqlx's ping before each acquire
    /// (`test_before_acquire(false)`: a round trip less while the transaction holds its
    /// connection) loses no request to a dead connection. (The tokio-postgres driver needs no
    /// such retry: its connections are read all the time, so the pool sees one closed and
    /// replaces it before lending it.)
    async fn begin(
        &self,
    ) -> std::result::Result<sqlx::Transaction<'static, Postgres>, sqlx::Error> {
        let attempts = self.pool.options().get_max_connections().saturating_add(1);
        let mut attempt = 1;
        loop {
            match self.pool.begin().await {
                Err(failed) if attempt < attempts && ended_by_the_server(&failed) => attempt += 1,
                begun => return begun,
            }
        }
    }
}

/// Whether `error` says the server had ended the connection: it was shut down or
/// terminated (SQLSTATE `57P01`, `57P02`), or the socket was closed under it. Not a refused
/// connection, which a new one would meet again.
fn ended_by_the_server(error: &sqlx::Error) -> bool {
    use std::io::ErrorKind;
    match error {
        sqlx::Error::Database(error) => {
            matches!(error.code().as_deref(), Some("57P01" | "57P02"))
        }
        sqlx::Error::Io(error) => matches!(
            error.kind(),
            ErrorKind::ConnectionReset
                | ErrorKind::ConnectionAborted
                | ErrorKind::BrokenPipe
                | ErrorKind::UnexpectedEof
        ),
        _ => false,
    }
}

/// A failure to get a connection changed nothing; any other may have.
fn error(error: sqlx::Error) -> Error {
    match error {
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) => {
            Error::Unavailable(Box::new(PostgresStoreError::Sqlx(error)))
        }
        error => Error::Backend(Box::new(PostgresStoreError::Sqlx(error))),
    }
}

#[async_trait]
impl Driver for Sqlx {
    type Connection = sqlx::Transaction<'static, Postgres>;

    /// sqlx sends one statement at a time: reading in the transaction would cost a replay
    /// two round trips (`BEGIN`, then the claim), where a read first costs it one.
    fn reads_while_claiming(&self) -> bool {
        false
    }

    async fn begin_claiming(
        &self,
        sql: &str,
        claiming: &Claiming<'_>,
        _counted: bool,
    ) -> Result<Begun<Self::Connection>> {
        let mut transaction = within_begin_timeout("sqlx", self.begin())
            .await?
            .map_err(error)?;
        let row: PgRow = sqlx::query(sql)
            .bind(claiming.key)
            .bind(claiming.endpoint)
            .bind(claiming.principal)
            .bind(claiming.fingerprint)
            .bind(claiming.token)
            .bind(claiming.lease)
            .bind(claiming.lock)
            .bind(claiming.request_lock)
            .fetch_one(&mut *transaction)
            .await
            .map_err(error)?;
        let (request_locked, locked) = (
            row.try_get(0).map_err(error)?,
            row.try_get(1).map_err(error)?,
        );
        let (claimed, holder_ran) = (
            row.try_get(2).map_err(error)?,
            row.try_get(3).map_err(error)?,
        );
        Ok(Begun {
            transaction,
            request_locked,
            locked,
            claimed,
            holder_ran,
            // A row committed since the read is read again, outside the transaction.
            found: None,
        })
    }

    async fn complete_and_commit(
        &self,
        mut transaction: Self::Connection,
        sql: &str,
        completion: &Completion<'_>,
    ) -> Result<()> {
        let written = sqlx::query(sql)
            .bind(completion.key)
            .bind(completion.endpoint)
            .bind(completion.principal)
            .bind(completion.token)
            .bind(completion.fingerprint)
            .bind(completion.status)
            .bind(completion.headers.as_slice())
            .bind(completion.body)
            .bind(completion.ttl)
            .bind(completion.notification.as_str())
            .bind(completion.resource_id.as_deref())
            .fetch_all(&mut *transaction)
            .await;
        if let Err(failed) = written {
            self.rollback(transaction).await;
            return Err(error(failed));
        }
        transaction.commit().await.map_err(error)
    }

    async fn rollback(&self, transaction: Self::Connection) {
        // A connection that fails to roll back is closed by sqlx, which rolls back too.
        let _ = transaction.rollback().await;
    }

    fn abandon(&self, transaction: Self::Connection) {
        // sqlx sends the `ROLLBACK` of a dropped transaction before its connection's next
        // statement.
        drop(transaction);
    }
}
