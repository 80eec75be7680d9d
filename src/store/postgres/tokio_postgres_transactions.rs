//! The transactional mode on the store's own tokio-postgres pool.

use async_trait::async_trait;
use deadpool_postgres::Pool;
use tokio_postgres::types::ToSql;

use super::{
    transactional::{Begun, Claiming, Driver, BEGIN_TIMEOUT},
    Completion,
};
use crate::{
    store::{Error, Result},
    transaction::PooledTransaction,
};

/// Transactions on connections of a deadpool pool.
pub(super) struct Pooled {
    pool: Pool,
}

impl Pooled {
    pub(super) fn new(pool: Pool) -> Self {
        Self { pool }
    }
}

#[async_trait]
impl Driver for Pooled {
    type Connection = PooledTransaction;

    async fn begin_claiming(
        &self,
        sql: &str,
        claiming: &Claiming<'_>,
    ) -> Result<Begun<PooledTransaction>> {
        let client = tokio::time::timeout(BEGIN_TIMEOUT, self.pool.get())
            .await
            .map_err(|_| {
                Error::Unavailable(
                    format!("no pooled connection within {BEGIN_TIMEOUT:?} for a transaction")
                        .into(),
                )
            })??;
        // From here on a failure closes the connection rather than pooling it mid-transaction.
        let transaction = PooledTransaction::new(client);
        let client = transaction.client();
        let statement = client.prepare_cached(sql).await?;
        let params: [&(dyn ToSql + Sync); 8] = [
            &claiming.key,
            &claiming.endpoint,
            &claiming.principal,
            &claiming.fingerprint,
            &claiming.token,
            &claiming.lease,
            &claiming.lock,
            &claiming.request_lock,
        ];
        // One round trip: the statement is sent right behind the `BEGIN`.
        let (begun, row) = tokio::join!(
            client.batch_execute("BEGIN"),
            client.query_one(&statement, &params)
        );
        begun?;
        let row = row?;
        let (request_locked, locked) = (row.try_get(0)?, row.try_get(1)?);
        let (claimed, holder_ran) = (row.try_get(2)?, row.try_get(3)?);
        Ok(Begun {
            transaction,
            request_locked,
            locked,
            claimed,
            holder_ran,
        })
    }

    async fn complete(
        &self,
        transaction: &mut PooledTransaction,
        sql: &str,
        completion: &Completion<'_>,
    ) -> Result<u64> {
        let client = transaction.client();
        let statement = client.prepare_cached(sql).await?;
        let rows = client.query(&statement, &completion.params()).await?;
        Ok(rows.len() as u64)
    }

    async fn commit(&self, transaction: PooledTransaction) -> Result<()> {
        transaction.client().batch_execute("COMMIT").await?;
        drop(transaction.ended());
        Ok(())
    }

    async fn rollback(&self, transaction: PooledTransaction) {
        if transaction.client().batch_execute("ROLLBACK").await.is_ok() {
            drop(transaction.ended());
        }
    }
}
