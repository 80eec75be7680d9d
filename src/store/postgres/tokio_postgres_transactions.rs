//! The transactional mode on the store's own tokio-postgres pool, whose statements are
//! pipelined: `BEGIN` and the claim go in one round trip, the completion and `COMMIT` in
//! another.

use async_trait::async_trait;
use deadpool_postgres::Pool;
use tokio_postgres::types::ToSql;

use super::{
    decode_claim_at,
    transactional::{within_begin_timeout, Begun, Claiming, Driver},
    Completion,
};
use crate::{store::Result, transaction::PooledTransaction};

/// Where the live row's columns begin in the claim's answer.
const FOUND_COLUMNS: usize = 4;

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

    fn reads_while_claiming(&self) -> bool {
        true
    }

    async fn begin_claiming(
        &self,
        sql: &str,
        claiming: &Claiming<'_>,
        counted: bool,
    ) -> Result<Begun<PooledTransaction>> {
        let client = within_begin_timeout("pooled", self.pool.get()).await??;
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
        let found = match row.try_get::<_, Option<bool>>(FOUND_COLUMNS)? {
            Some(_) => Some(decode_claim_at(&row, FOUND_COLUMNS, counted)?),
            None => None,
        };
        Ok(Begun {
            transaction,
            request_locked,
            locked,
            claimed,
            holder_ran,
            found,
        })
    }

    async fn complete_and_commit(
        &self,
        transaction: PooledTransaction,
        sql: &str,
        completion: &Completion<'_>,
    ) -> Result<()> {
        let client = transaction.client();
        let statement = client.prepare_cached(sql).await?;
        // One round trip. A completion that fails aborts the transaction, and the `COMMIT`
        // behind it then rolls back (answering without an error).
        let params = completion.params();
        let (written, committed) = tokio::join!(
            client.query(&statement, &params),
            client.batch_execute("COMMIT")
        );
        committed?;
        // Ended either way: the connection is out of its transaction.
        drop(transaction.ended());
        written?;
        Ok(())
    }

    async fn rollback(&self, transaction: PooledTransaction) {
        if transaction.client().batch_execute("ROLLBACK").await.is_ok() {
            drop(transaction.ended());
        }
    }

    fn abandon(&self, transaction: PooledTransaction) {
        let rolling_back = async move {
            if transaction.client().batch_execute("ROLLBACK").await.is_ok() {
                drop(transaction.ended());
            }
        };
        tokio::spawn(rolling_back);
    }
}
