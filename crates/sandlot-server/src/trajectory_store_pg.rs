//! PostgreSQL implementation of [`TrajectoryStore`] (cluster mode): the same tables and JSON
//! encodings as the SQLite one (schema: `migrations/pg/V1__trajectory_log.sql`), shared by
//! every server of a cluster through one database.
//!
//! Concurrency (READ COMMITTED, PostgreSQL's default):
//! - [`TrajectoryStore::append`] first inserts the trajectory's row if missing (`ON CONFLICT
//!   DO NOTHING`, which waits for a concurrent uncommitted insert of the same id), then
//!   reads `next_step` `FOR UPDATE`: two servers appending to one trajectory serialise on
//!   that row lock, and the second sees the first's committed `next_step` and gets
//!   [`TrajectoryStoreError::NotNext`]. The `(trajectory, step)` primary key backs this up.
//! - Blobs are shared by hash. An append takes a row lock on each blob it references
//!   (`ON CONFLICT DO UPDATE`), and a delete locks the blobs of the trajectory (`FOR
//!   UPDATE`) before dropping those without references, so a delete never drops a blob that
//!   a concurrent append just referenced.
use super::*;
use deadpool_postgres::{GenericClient, Pool};

fn pg(op: &'static str) -> impl FnOnce(tokio_postgres::Error) -> TrajectoryStoreError {
    move |source| TrajectoryStoreError::Pg { op, source }
}

/// PostgreSQL implementation of [`TrajectoryStore`]. Cheap to share behind an `Arc`.
pub struct PgTrajectoryStore {
    pool: Pool,
}

impl PgTrajectoryStore {
    /// A store on `pool`, whose database [`crate::pg::connect`] has migrated.
    pub fn new(pool: Pool) -> PgTrajectoryStore {
        PgTrajectoryStore { pool }
    }

    async fn conn(&self) -> Result<deadpool_postgres::Object> {
        self.pool
            .get()
            .await
            .map_err(|e| TrajectoryStoreError::Unavailable(e.to_string()))
    }

    async fn load_blob<C: GenericClient>(c: &C, t: &str, step: u64, h: &str) -> Result<Bytes> {
        c.query_opt("SELECT data FROM blobs WHERE sha256 = $1", &[&h])
            .await
            .map_err(pg("select blob"))?
            .map(|r| Bytes::from(r.get::<_, Vec<u8>>(0)))
            .ok_or_else(|| TrajectoryStoreError::Corrupt {
                trajectory: t.into(),
                step,
                what: format!("blob {h} missing"),
            })
    }

    async fn decode_result<C: GenericClient>(
        c: &C,
        t: &str,
        step: u64,
        json: &str,
    ) -> Result<StepResult> {
        let s: StoredResult =
            serde_json::from_str(json).map_err(|e| TrajectoryStoreError::Corrupt {
                trajectory: t.into(),
                step,
                what: format!("result: {e}"),
            })?;
        Ok(match s {
            StoredResult::Exec {
                mut r,
                stdout_blob,
                stderr_blob,
            } => {
                if let Some(h) = stdout_blob {
                    let raw = Self::load_blob(c, t, step, &h).await?;
                    (r.stdout, r.stdout_b64) = sandlot_api::text_and_b64(&raw);
                }
                if let Some(h) = stderr_blob {
                    let raw = Self::load_blob(c, t, step, &h).await?;
                    (r.stderr, r.stderr_b64) = sandlot_api::text_and_b64(&raw);
                }
                StepResult::Exec(r)
            }
            StoredResult::Done => StepResult::Done,
            StoredResult::Data { blob } => {
                StepResult::Data(Self::load_blob(c, t, step, &blob).await?)
            }
            StoredResult::List { entries } => StepResult::List(entries),
        })
    }

    async fn decode_request<C: GenericClient>(
        c: &C,
        t: &str,
        step: u64,
        json: &str,
    ) -> Result<StepRequest> {
        let s: StoredRequest =
            serde_json::from_str(json).map_err(|e| TrajectoryStoreError::Corrupt {
                trajectory: t.into(),
                step,
                what: format!("request: {e}"),
            })?;
        Ok(match s {
            StoredRequest::Exec { r } => StepRequest::Exec(r),
            StoredRequest::WriteFile { path, data_blob } => StepRequest::WriteFile {
                data: Self::load_blob(c, t, step, &data_blob).await?,
                path,
            },
            StoredRequest::RemoveFile { path } => StepRequest::RemoveFile { path },
            StoredRequest::ReadFile { path } => StepRequest::ReadFile { path },
            StoredRequest::ListDir { path } => StepRequest::ListDir { path },
        })
    }

    /// Number of rows in `blobs` (tests: unused blobs are dropped).
    #[cfg(test)]
    pub(crate) async fn blob_count(&self) -> i64 {
        let c = self.conn().await.unwrap();
        c.query_one("SELECT count(*) FROM blobs", &[])
            .await
            .unwrap()
            .get(0)
    }
}

#[async_trait]
impl TrajectoryStore for PgTrajectoryStore {
    async fn next_step(&self, trajectory: &str) -> Result<u64> {
        let c = self.conn().await?;
        Ok(c.query_opt(
            "SELECT next_step FROM trajectories WHERE id = $1",
            &[&trajectory],
        )
        .await
        .map_err(pg("select next step"))?
        .map_or(0, |r| r.get::<_, i64>(0) as u64))
    }

    async fn get_step(&self, trajectory: &str, step: u64) -> Result<Option<LoggedStep>> {
        let c = self.conn().await?;
        let row = c
            .query_opt(
                "SELECT kind, digest, result FROM steps WHERE trajectory = $1 AND step = $2",
                &[&trajectory, &(step as i64)],
            )
            .await
            .map_err(pg("select step"))?;
        let Some(row) = row else {
            return Ok(None);
        };
        let kind: String = row.get(0);
        let kind = kind_of(&kind).ok_or_else(|| TrajectoryStoreError::Corrupt {
            trajectory: trajectory.into(),
            step,
            what: format!("kind {kind:?}"),
        })?;
        let result: String = row.get(2);
        let result = Self::decode_result(&c, trajectory, step, &result).await?;
        Ok(Some(LoggedStep {
            step,
            kind,
            digest: row.get(1),
            result,
        }))
    }

    async fn record_replay(&self, trajectory: &str, step: u64, now_ms: i64) -> Result<()> {
        let mut c = self.conn().await?;
        let tx = c.transaction().await.map_err(pg("begin"))?;
        tx.execute(
            "UPDATE steps SET replay_count = replay_count + 1 WHERE trajectory = $1 AND step = $2",
            &[&trajectory, &(step as i64)],
        )
        .await
        .map_err(pg("update replay count"))?;
        tx.execute(
            "UPDATE trajectories SET replayed_total = replayed_total + 1, last_activity = $2
             WHERE id = $1",
            &[&trajectory, &now_ms],
        )
        .await
        .map_err(pg("update replay total"))?;
        tx.commit().await.map_err(pg("commit"))
    }

    async fn append(
        &self,
        trajectory: &str,
        step: u64,
        request: &StepRequest,
        digest: &str,
        result: &StepResult,
        now_ms: i64,
    ) -> Result<()> {
        let mut blobs = Blobs::new();
        let req_json = encode_request(request, &mut blobs);
        let res_json = encode_result(result, &mut blobs);
        // Blob row locks in a fixed order, so two appends sharing blobs cannot deadlock.
        blobs.sort_by(|a, b| a.0.cmp(&b.0));
        let mut c = self.conn().await?;
        let tx = c.transaction().await.map_err(pg("begin"))?;
        // A row to lock even for a new trajectory (rolled back with a refused append).
        tx.execute(
            "INSERT INTO trajectories (id, next_step, replayed_total, created_at, last_activity)
             VALUES ($1, 0, 0, $2, $2) ON CONFLICT (id) DO NOTHING",
            &[&trajectory, &now_ms],
        )
        .await
        .map_err(pg("insert trajectory"))?;
        let next = tx
            .query_one(
                "SELECT next_step FROM trajectories WHERE id = $1 FOR UPDATE",
                &[&trajectory],
            )
            .await
            .map_err(pg("lock trajectory"))?
            .get::<_, i64>(0) as u64;
        if next != step {
            return Err(TrajectoryStoreError::NotNext {
                trajectory: trajectory.into(),
                step,
                next,
            });
        }
        for (h, data) in &blobs {
            // DO UPDATE (not DO NOTHING) takes the row lock a concurrent delete waits on.
            tx.execute(
                "INSERT INTO blobs (sha256, data) VALUES ($1, $2)
                 ON CONFLICT (sha256) DO UPDATE SET sha256 = EXCLUDED.sha256",
                &[h, &&data[..]],
            )
            .await
            .map_err(pg("insert blob"))?;
            tx.execute(
                "INSERT INTO step_blobs (trajectory, step, sha256) VALUES ($1, $2, $3)",
                &[&trajectory, &(step as i64), h],
            )
            .await
            .map_err(pg("insert step blob"))?;
        }
        tx.execute(
            "INSERT INTO steps (trajectory, step, kind, digest, request, result, exit_code,
             created_at, replay_count) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 0)",
            &[
                &trajectory,
                &(step as i64),
                &request.kind().as_str(),
                &digest,
                &req_json,
                &res_json,
                &result.exit_code(),
                &now_ms,
            ],
        )
        .await
        .map_err(pg("insert step"))?;
        tx.execute(
            "UPDATE trajectories SET next_step = $2, last_activity = $3 WHERE id = $1",
            &[&trajectory, &((step + 1) as i64), &now_ms],
        )
        .await
        .map_err(pg("update trajectory"))?;
        tx.commit().await.map_err(pg("commit"))
    }

    async fn summary(&self, trajectory: &str) -> Result<Option<LogSummary>> {
        let mut c = self.conn().await?;
        // One snapshot for the head and the steps.
        let tx = c
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await
            .map_err(pg("begin"))?;
        let head = tx
            .query_opt(
                "SELECT next_step, replayed_total FROM trajectories WHERE id = $1",
                &[&trajectory],
            )
            .await
            .map_err(pg("select trajectory"))?;
        let Some(head) = head else {
            return Ok(None);
        };
        let steps = tx
            .query(
                "SELECT step, kind, digest, exit_code, created_at, replay_count FROM steps
                 WHERE trajectory = $1 ORDER BY step",
                &[&trajectory],
            )
            .await
            .map_err(pg("select steps"))?
            .into_iter()
            .map(|r| StepSummary {
                step: r.get::<_, i64>(0) as u64,
                kind: r.get(1),
                digest: r.get(2),
                exit_code: r.get(3),
                created_at_ms: r.get(4),
                replay_count: r.get::<_, i64>(5) as u64,
            })
            .collect();
        tx.commit().await.map_err(pg("commit"))?;
        Ok(Some(LogSummary {
            next_step: head.get::<_, i64>(0) as u64,
            steps,
            replayed_total: head.get::<_, i64>(1) as u64,
        }))
    }

    async fn mutating_steps(
        &self,
        trajectory: &str,
    ) -> Result<Vec<(u64, StepRequest, StepResult)>> {
        let c = self.conn().await?;
        let rows = c
            .query(
                "SELECT step, request, result FROM steps WHERE trajectory = $1
                 AND kind IN ('exec', 'write_file', 'remove_file') ORDER BY step",
                &[&trajectory],
            )
            .await
            .map_err(pg("select mutating steps"))?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let step = r.get::<_, i64>(0) as u64;
            let req: String = r.get(1);
            let res: String = r.get(2);
            out.push((
                step,
                Self::decode_request(&c, trajectory, step, &req).await?,
                Self::decode_result(&c, trajectory, step, &res).await?,
            ));
        }
        Ok(out)
    }

    async fn delete(&self, trajectory: &str) -> Result<bool> {
        let mut c = self.conn().await?;
        let tx = c.transaction().await.map_err(pg("begin"))?;
        let n = tx
            .execute("DELETE FROM trajectories WHERE id = $1", &[&trajectory])
            .await
            .map_err(pg("delete trajectory"))?;
        tx.execute("DELETE FROM steps WHERE trajectory = $1", &[&trajectory])
            .await
            .map_err(pg("delete steps"))?;
        let hashes: Vec<String> = tx
            .query(
                "DELETE FROM step_blobs WHERE trajectory = $1 RETURNING sha256",
                &[&trajectory],
            )
            .await
            .map_err(pg("delete blob refs"))?
            .into_iter()
            .map(|r| r.get(0))
            .collect();
        if !hashes.is_empty() {
            // Lock first (sorted: a fixed order across deleters), then drop the unused.
            tx.query(
                "SELECT sha256 FROM blobs WHERE sha256 = ANY($1) ORDER BY sha256 FOR UPDATE",
                &[&hashes],
            )
            .await
            .map_err(pg("lock blobs"))?;
            tx.execute(
                "DELETE FROM blobs b WHERE b.sha256 = ANY($1)
                 AND NOT EXISTS (SELECT 1 FROM step_blobs s WHERE s.sha256 = b.sha256)",
                &[&hashes],
            )
            .await
            .map_err(pg("delete blobs"))?;
        }
        tx.commit().await.map_err(pg("commit"))?;
        Ok(n == 1)
    }

    async fn inactive_since(&self, before_ms: i64) -> Result<Vec<String>> {
        let c = self.conn().await?;
        Ok(c.query(
            "SELECT id FROM trajectories WHERE last_activity < $1 ORDER BY id",
            &[&before_ms],
        )
        .await
        .map_err(pg("select inactive"))?
        .into_iter()
        .map(|r| r.get(0))
        .collect())
    }
}
