//! The handler's side of the transactional PostgreSQL mode: the database transaction the
//! layer opened for a request, in which the handler writes what the record commits with.
//!
//! Behind an [`IdempotencyLayer`](crate::IdempotencyLayer) on a transactional
//! [`PostgresStore`](crate::PostgresStore) ([`transactional`](crate::PostgresStore::transactional)
//! or, with feature `sqlx`, `transactional_sqlx`), every execution runs in a transaction
//! of its own: the claim of its key, the handler's writes and its completed record commit
//! together, or none of them does. The request carries the transaction in its extensions
//! as an [`InTransaction`]; a handler takes it with [`InTransaction::lock`], or as an axum
//! extractor ([`PostgresTransaction`], `SqlxTransaction`).
//!
//! The layer commits after the handler's response is recorded, so the handler must not
//! commit or roll back itself, nor keep the transaction past its response (a task spawned
//! with it): a transaction still held when the layer comes to commit is rolled back, and
//! the client gets `503`. A `COMMIT` the handler sent would commit the claim with its
//! writes before the record, with no lease renewed: a released outcome's writes would stay,
//! and once the lease ran out another request could run the operation again. So the
//! tokio-postgres flavour lends the connection for statements only (`&`): its
//! `transaction()`, which sends `BEGIN` and then `COMMIT` on a plain client, does not
//! compile. With sqlx, `begin()` on the lent connection makes a savepoint.
//!
//! Nor may the response's body stream from the transaction (tokio-postgres's `query_raw`
//! rows, say): the layer reads a body up to `max_response_body` before committing, but one
//! larger, or one whose status releases the key, is handed on after the commit or the
//! rollback, which then waits behind the rows nobody reads. That wait is bounded by the
//! lease: the transaction's connection is then closed, which rolls back, and the client
//! gets `503`.

use std::{
    fmt,
    ops::{Deref, DerefMut},
    sync::Arc,
};

use tokio::sync::{Mutex, OwnedMutexGuard};

/// A connection inside an open transaction, as a handler uses it.
pub trait Connection: Send + 'static {
    /// What the handler runs its statements on.
    type Target: ?Sized;
    /// The connection, for statements that borrow it.
    fn connection(&self) -> &Self::Target;
}

/// A connection a handler may also use mutably, because nothing it can do with `&mut`
/// ends the layer's transaction: sqlx's, whose executors need `&mut` and whose `begin()`
/// inside a transaction makes a savepoint. Not tokio-postgres's, whose `transaction()`
/// would commit the layer's transaction.
pub trait ConnectionMut: Connection {
    /// The connection, for statements that need it mutably.
    fn connection_mut(&mut self) -> &mut Self::Target;
}

/// The request's open transaction, in its extensions while the handler runs: cloned cheaply,
/// and locked by whichever part of the handler writes.
pub struct InTransaction<C>(Arc<Mutex<Option<C>>>);

impl<C> Clone for InTransaction<C> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<C> fmt::Debug for InTransaction<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InTransaction").finish_non_exhaustive()
    }
}

impl<C: Connection> InTransaction<C> {
    pub(crate) fn new(connection: C) -> Self {
        Self(Arc::new(Mutex::new(Some(connection))))
    }

    /// The transaction, for this part of the handler alone until the guard is dropped.
    /// [`TransactionEnded`] once the layer has committed or rolled it back.
    pub async fn lock(&self) -> Result<TransactionGuard<C>, TransactionEnded> {
        let guard = Arc::clone(&self.0).lock_owned().await;
        if guard.is_some() {
            Ok(TransactionGuard(guard))
        } else {
            Err(TransactionEnded)
        }
    }

    /// The transaction, taken back by the layer to commit or roll back: `None` while a
    /// handler still holds it (or once taken).
    pub(crate) fn take(&self) -> Option<C> {
        self.0.try_lock().ok()?.take()
    }
}

/// The request's transaction, held by one part of the handler: it derefs to the connection
/// ([`Connection::Target`]) the statements run on, mutably only where nothing done with
/// `&mut` ends the transaction ([`ConnectionMut`]). Also an axum extractor (feature
/// `axum`), which answers `500` on a route without a transactional layer; take
/// `Option<…>` on a route that may run without one.
pub struct TransactionGuard<C>(OwnedMutexGuard<Option<C>>);

impl<C: Connection> Deref for TransactionGuard<C> {
    type Target = C::Target;

    fn deref(&self) -> &C::Target {
        self.0
            .as_ref()
            .expect("locked only while open")
            .connection()
    }
}

impl<C: ConnectionMut> DerefMut for TransactionGuard<C> {
    fn deref_mut(&mut self) -> &mut C::Target {
        self.0
            .as_mut()
            .expect("locked only while open")
            .connection_mut()
    }
}

impl<C> fmt::Debug for TransactionGuard<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransactionGuard").finish_non_exhaustive()
    }
}

/// The transaction was already committed or rolled back by the layer: the handler runs
/// outside its request's execution (a task it spawned).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the request's transaction has ended: the layer committed or rolled it back")]
pub struct TransactionEnded;

/// The transaction of the tokio-postgres flavour
/// ([`PostgresStore::transactional`](crate::PostgresStore::transactional)): a pooled
/// connection of the store's own pool, inside `BEGIN`. It derefs to the client for
/// statements (`execute`, `query`, `prepare_cached`, ...), not mutably: the client's
/// `transaction()` would send `BEGIN` inside the layer's transaction, and its `commit()`
/// would commit that transaction, the claim with it, before the record.
///
/// ```compile_fail,E0596
/// # use tower_idempotency::transaction::PostgresTransaction;
/// async fn create_order(mut tx: PostgresTransaction) {
///     let nested = tx.transaction().await.unwrap(); // does not compile: no `&mut`
///     nested.commit().await.unwrap();
/// }
/// ```
///
/// ```no_run
/// use axum::{http::StatusCode, routing::post, Router};
/// use tower_idempotency::{transaction::PostgresTransaction, IdempotencyLayer, PostgresStore};
///
/// async fn create_order(tx: PostgresTransaction) -> Result<StatusCode, StatusCode> {
///     tx.execute("INSERT INTO orders (id) VALUES ($1)", &[&"ord_1"])
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     Ok(StatusCode::CREATED)
/// }
///
/// # async fn run() -> Result<(), tower_idempotency::store::PostgresStoreError> {
/// let store = PostgresStore::connect("postgres://app@localhost/app").await?.transactional();
/// let app: Router = Router::new()
///     .route("/orders", post(create_order))
///     .layer(IdempotencyLayer::new(store));
/// # Ok(())
/// # }
/// ```
pub type PostgresTransaction = TransactionGuard<PooledTransaction>;

/// A connection of a [`deadpool_postgres::Pool`] inside a transaction the layer began. A
/// connection dropped before the layer ended its transaction (a runtime shutting down) is
/// closed rather than returned to the pool, and the database rolls the transaction back.
pub struct PooledTransaction {
    client: Option<deadpool_postgres::Client>,
}

impl PooledTransaction {
    pub(crate) fn new(client: deadpool_postgres::Client) -> Self {
        Self {
            client: Some(client),
        }
    }

    pub(crate) fn client(&self) -> &deadpool_postgres::Client {
        self.client.as_ref().expect("present until ended")
    }

    /// The connection, its transaction ended (committed or rolled back): it goes back to
    /// the pool when dropped.
    pub(crate) fn ended(mut self) -> deadpool_postgres::Client {
        self.client.take().expect("present until ended")
    }
}

impl fmt::Debug for PooledTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PooledTransaction").finish_non_exhaustive()
    }
}

impl Drop for PooledTransaction {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            // Still inside its transaction: closed, never handed to another request.
            drop(deadpool_postgres::Object::take(client));
        }
    }
}

impl Connection for PooledTransaction {
    type Target = deadpool_postgres::ClientWrapper;

    fn connection(&self) -> &Self::Target {
        self.client()
    }
}

/// The transaction of the sqlx flavour (`PostgresStore::transactional_sqlx`): it derefs to
/// a [`sqlx::PgConnection`], so `&mut *tx` is an [`sqlx::Executor`].
///
/// ```no_run
/// use axum::{http::StatusCode, routing::post, Router};
/// use tower_idempotency::{transaction::SqlxTransaction, IdempotencyLayer, PostgresStore};
///
/// async fn create_order(mut tx: SqlxTransaction) -> Result<StatusCode, StatusCode> {
///     sqlx::query("INSERT INTO orders (id) VALUES ($1)")
///         .bind("ord_1")
///         .execute(&mut *tx)
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     Ok(StatusCode::CREATED)
/// }
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let url = "postgres://app@localhost/app";
/// let pool = sqlx::PgPool::connect(url).await?;
/// let store = PostgresStore::connect(url).await?.transactional_sqlx(pool);
/// let app: Router = Router::new()
///     .route("/orders", post(create_order))
///     .layer(IdempotencyLayer::new(store));
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "sqlx")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlx")))]
pub type SqlxTransaction = TransactionGuard<sqlx::Transaction<'static, sqlx::Postgres>>;

#[cfg(feature = "sqlx")]
impl Connection for sqlx::Transaction<'static, sqlx::Postgres> {
    type Target = sqlx::PgConnection;

    fn connection(&self) -> &Self::Target {
        self
    }
}

#[cfg(feature = "sqlx")]
impl ConnectionMut for sqlx::Transaction<'static, sqlx::Postgres> {
    fn connection_mut(&mut self) -> &mut Self::Target {
        self
    }
}

#[cfg(feature = "axum")]
mod extract {
    use axum::{
        extract::{FromRequestParts, OptionalFromRequestParts},
        http::{request::Parts, StatusCode},
    };

    use super::{Connection, InTransaction, TransactionGuard};

    impl<C: Connection, S: Send + Sync> FromRequestParts<S> for TransactionGuard<C> {
        type Rejection = (StatusCode, &'static str);

        async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
            let found =
                <Self as OptionalFromRequestParts<S>>::from_request_parts(parts, state).await?;
            found.ok_or((
                StatusCode::INTERNAL_SERVER_ERROR,
                "no transaction: the route is not behind a transactional IdempotencyLayer",
            ))
        }
    }

    impl<C: Connection, S: Send + Sync> OptionalFromRequestParts<S> for TransactionGuard<C> {
        type Rejection = (StatusCode, &'static str);

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            let Some(transaction) = parts.extensions.get::<InTransaction<C>>().cloned() else {
                return Ok(None);
            };
            transaction.lock().await.map(Some).map_err(|_| {
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the request's transaction has ended",
                )
            })
        }
    }
}
