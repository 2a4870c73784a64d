-- Forgets the answers "409 already_refunded" that V42 stopped storing but left in place
-- (found from outside, a rollout from V40, 2026-12-07): before V42, a refund of a top-up under
-- another key while its first refund was under way at the processor was answered 409
-- already_refunded and stored; when that first refund then failed and was credited back, the
-- key kept answering (and its lookup kept saying) "already refunded" for a top-up that was
-- not refunded, for the rest of its replay window.
--
-- Since V42 such a request stores nothing and its retry answers how the first refund ended;
-- this puts the keys stored before it in the same place: a key stored as already_refunded
-- for a top-up that is not refunded now (its refund failed, or is still under way) is
-- forgotten, so that its retry refunds the top-up, or waits for the refund under way, as a
-- retry after V42 does. A top-up refunded now keeps its answers, right in either case. Only
-- keys within their replay window are forgotten: one past it is refused as expired, as every
-- key past its window is, and is never run again.
--
-- Since V42 no such key is stored, by any replica (old ones call V42's function too), so
-- this runs once. It reads the whole key table once (no index names an operation) and locks
-- only the rows it deletes: payments go on meanwhile.

DELETE FROM idempotency_keys k
 USING top_ups t
 WHERE k.operation = 'refund_top_up'
   AND k.error_code = 'already_refunded'
   AND k.expires_at > now()
   AND t.tenant_id = k.tenant_id
   AND k.path = '/top-ups/' || t.top_up_id::text || '/refund'
   AND t.refund_state IS DISTINCT FROM 'refunded';
