-- The column's comment says what V47 added to it (found from outside: a rollout probe read
-- schedule_start = 1 on deliveries never resent, recovered or enabled, and the comment did
-- not say why).
COMMENT ON COLUMN webhook_deliveries.schedule_start IS
    'attempts that do not count against the retry schedule: those made before the delivery was last reopened (resend, recover, enable), after which its schedule starts again, and each attempt lost with its process (its lease ran out unrecorded; V47)';
