-- The schema the migrations leave (scripts/schema.sh; `make schema` rewrites it, `make check`
-- fails while it is stale). Functions: schema/functions/.

--
-- Name: oncepay_account_id; Type: DOMAIN; Schema: public; Owner: -
--

CREATE DOMAIN public.oncepay_account_id AS text
	CONSTRAINT oncepay_account_id_check CHECK ((VALUE ~ '^[A-Za-z0-9_.:-]{1,64}$'::text));


--
-- Name: oncepay_amount; Type: DOMAIN; Schema: public; Owner: -
--

CREATE DOMAIN public.oncepay_amount AS bigint
	CONSTRAINT oncepay_amount_check CHECK (((VALUE >= 1) AND (VALUE <= '1000000000000'::bigint)));


--
-- Name: oncepay_balance; Type: DOMAIN; Schema: public; Owner: -
--

CREATE DOMAIN public.oncepay_balance AS bigint
	CONSTRAINT oncepay_balance_check CHECK ((VALUE >= 0));


--
-- Name: oncepay_decline; Type: TYPE; Schema: public; Owner: -
--

CREATE TYPE public.oncepay_decline AS ENUM (
    'insufficient_funds',
    'account_not_found',
    'not_found',
    'already_refunded',
    'account_exists',
    'card_declined',
    'invalid_payment_method',
    'too_many_endpoints',
    'invalid_request',
    'refund_failed'
);


--
-- Name: oncepay_outcome; Type: TYPE; Schema: public; Owner: -
--

CREATE TYPE public.oncepay_outcome AS ENUM (
    'created',
    'replayed',
    'declined',
    'key_reused',
    'expired'
);


SET default_tablespace = '';

SET default_table_access_method = heap;

--
-- Name: payments; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.payments (
    tenant_id uuid NOT NULL,
    payment_id uuid NOT NULL,
    account_id text NOT NULL,
    amount public.oncepay_amount NOT NULL,
    balance_after public.oncepay_balance NOT NULL,
    idempotency_key text,
    created_at timestamp with time zone NOT NULL,
    refunded_at timestamp with time zone,
    balance_after_refund bigint,
    CONSTRAINT payments_refund_check CHECK (((refunded_at IS NULL) = (balance_after_refund IS NULL)))
);


--
-- Name: oncepay_batch_answer; Type: TYPE; Schema: public; Owner: -
--

CREATE TYPE public.oncepay_batch_answer AS (
	item integer,
	outcome public.oncepay_outcome,
	decline public.oncepay_decline,
	expires_at timestamp with time zone,
	resource public.payments
);


--
-- Name: oncepay_operation; Type: TYPE; Schema: public; Owner: -
--

CREATE TYPE public.oncepay_operation AS ENUM (
    'pay',
    'refund',
    'deposit',
    'open_account',
    'transfer',
    'top_up',
    'refund_top_up',
    'create_webhook_endpoint',
    'rotate_webhook_secret',
    'enable_webhook_endpoint',
    'resend_webhook_event',
    'recover_webhook_endpoint'
);


--
-- Name: oncepay_claim_args; Type: TYPE; Schema: public; Owner: -
--

CREATE TYPE public.oncepay_claim_args AS (
	key text,
	derived boolean,
	fingerprint bytea,
	operation public.oncepay_operation,
	method text,
	path text,
	window_secs integer,
	inflight_wait_ms integer,
	success_status smallint,
	decline_statuses jsonb
);


--
-- Name: oncepay_claimed; Type: TYPE; Schema: public; Owner: -
--

CREATE TYPE public.oncepay_claimed AS (
	outcome public.oncepay_outcome,
	decline public.oncepay_decline,
	resource_id text,
	expires_at timestamp with time zone
);


--
-- Name: oncepay_fingerprint; Type: DOMAIN; Schema: public; Owner: -
--

CREATE DOMAIN public.oncepay_fingerprint AS bytea
	CONSTRAINT oncepay_fingerprint_check CHECK ((octet_length(VALUE) = 32));


--
-- Name: oncepay_http_method; Type: DOMAIN; Schema: public; Owner: -
--

CREATE DOMAIN public.oncepay_http_method AS text
	CONSTRAINT oncepay_http_method_check CHECK ((VALUE = ANY (ARRAY['POST'::text, 'PATCH'::text, 'PUT'::text, 'DELETE'::text])));


--
-- Name: oncepay_idempotency_key; Type: DOMAIN; Schema: public; Owner: -
--

CREATE DOMAIN public.oncepay_idempotency_key AS text
	CONSTRAINT oncepay_idempotency_key_check CHECK (((length(VALUE) >= 1) AND (length(VALUE) <= 255)));


--
-- Name: oncepay_key_status; Type: DOMAIN; Schema: public; Owner: -
--

CREATE DOMAIN public.oncepay_key_status AS smallint
	CONSTRAINT oncepay_key_status_check CHECK ((((VALUE >= 200) AND (VALUE <= 299)) OR ((VALUE >= 400) AND (VALUE <= 499))));


--
-- Name: oncepay_opening_balance; Type: DOMAIN; Schema: public; Owner: -
--

CREATE DOMAIN public.oncepay_opening_balance AS bigint
	CONSTRAINT oncepay_opening_balance_check CHECK (((VALUE >= 0) AND (VALUE <= '1000000000000'::bigint)));


--
-- Name: oncepay_top_up_recovery_point; Type: DOMAIN; Schema: public; Owner: -
--

CREATE DOMAIN public.oncepay_top_up_recovery_point AS text
	CONSTRAINT oncepay_top_up_recovery_point_check CHECK ((VALUE = ANY (ARRAY['started'::text, 'intent_created'::text, 'finished'::text])));


--
-- Name: oncepay_top_up_refund_state; Type: DOMAIN; Schema: public; Owner: -
--

CREATE DOMAIN public.oncepay_top_up_refund_state AS text
	CONSTRAINT oncepay_top_up_refund_state_check CHECK ((VALUE = ANY (ARRAY['debited'::text, 'refunded'::text])));


--
-- Name: oncepay_top_up_status; Type: DOMAIN; Schema: public; Owner: -
--

CREATE DOMAIN public.oncepay_top_up_status AS text
	CONSTRAINT oncepay_top_up_status_check CHECK ((VALUE = ANY (ARRAY['processing'::text, 'succeeded'::text, 'failed'::text, 'refunded'::text])));


--
-- Name: oncepay_webhook_event_type; Type: DOMAIN; Schema: public; Owner: -
--

CREATE DOMAIN public.oncepay_webhook_event_type AS text
	CONSTRAINT oncepay_webhook_event_type_check CHECK ((VALUE = ANY (ARRAY['payment.succeeded'::text, 'payment.refunded'::text, 'deposit.succeeded'::text, 'transfer.succeeded'::text, 'top_up.succeeded'::text, 'top_up.failed'::text, 'top_up.refunded'::text, 'top_up.refund_failed'::text])));


--
-- Name: webhook_endpoints; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.webhook_endpoints (
    tenant_id uuid NOT NULL,
    endpoint_id uuid NOT NULL,
    url text NOT NULL,
    event_types text[],
    secret_encrypted bytea NOT NULL,
    previous_secret_encrypted bytea,
    previous_secret_expires_at timestamp with time zone,
    idempotency_key text,
    created_at timestamp with time zone NOT NULL,
    disabled_at timestamp with time zone,
    disabled_reason text,
    deleted_at timestamp with time zone,
    created_sequence bigint,
    failing_since timestamp with time zone,
    secret_from_key text,
    CONSTRAINT webhook_endpoints_event_types_check CHECK (((event_types IS NULL) OR ((event_types)::public.oncepay_webhook_event_type[] IS NOT NULL)))
);


--
-- Name: COLUMN webhook_endpoints.created_sequence; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON COLUMN public.webhook_endpoints.created_sequence IS 'the events'' sequence when the endpoint was created: it receives the events of higher sequence (NULL: created before V22, receives every event fanned out since)';


--
-- Name: COLUMN webhook_endpoints.failing_since; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON COLUMN public.webhook_endpoints.failing_since IS 'start of the first failed attempt since the last successful one; NULL while attempts succeed';


--
-- Name: COLUMN webhook_endpoints.secret_from_key; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON COLUMN public.webhook_endpoints.secret_from_key IS 'the idempotency key of the request that made the current secret (creation or rotation); its replay shows the secret, others do not';


--
-- Name: deposits; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.deposits (
    tenant_id uuid NOT NULL,
    deposit_id uuid NOT NULL,
    account_id text NOT NULL,
    amount public.oncepay_amount NOT NULL,
    balance_after bigint NOT NULL,
    idempotency_key text,
    created_at timestamp with time zone NOT NULL
);


--
-- Name: webhook_events; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.webhook_events (
    tenant_id uuid NOT NULL,
    event_id uuid NOT NULL,
    event_type text NOT NULL,
    resource_id text NOT NULL,
    data jsonb,
    created_at timestamp with time zone NOT NULL,
    sequence bigint,
    awaiting_fan_out boolean
)
WITH (autovacuum_vacuum_scale_factor='0', autovacuum_vacuum_threshold='5000', autovacuum_vacuum_cost_delay='0');


--
-- Name: COLUMN webhook_events.data; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON COLUMN public.webhook_events.data IS 'the event''s data; NULL for payment.succeeded written since V18: rendered by oncepay_event_data';


--
-- Name: COLUMN webhook_events.awaiting_fan_out; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON COLUMN public.webhook_events.awaiting_fan_out IS 'true: committed, deliveries not yet written; NULL: fanned out (or written before V14); false: fanned out to no endpoint';


--
-- Name: accounts; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.accounts (
    tenant_id uuid NOT NULL,
    account_id public.oncepay_account_id NOT NULL,
    balance public.oncepay_balance NOT NULL,
    opening_balance public.oncepay_opening_balance NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL
);


--
-- Name: webhook_recoveries; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.webhook_recoveries (
    tenant_id uuid NOT NULL,
    recovery_id uuid NOT NULL,
    endpoint_id uuid NOT NULL,
    since timestamp with time zone NOT NULL,
    deliveries integer NOT NULL,
    idempotency_key text,
    created_at timestamp with time zone NOT NULL
);


--
-- Name: top_ups; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.top_ups (
    tenant_id uuid NOT NULL,
    top_up_id uuid NOT NULL,
    account_id public.oncepay_account_id NOT NULL,
    amount public.oncepay_amount NOT NULL,
    currency text NOT NULL,
    payment_method text NOT NULL,
    status public.oncepay_top_up_status NOT NULL,
    recovery_point public.oncepay_top_up_recovery_point NOT NULL,
    processor_payment_id text,
    failure_code text,
    decline_code text,
    balance_after bigint,
    idempotency_key text,
    refund_state public.oncepay_top_up_refund_state,
    refund_key text,
    processor_refund_id text,
    balance_after_refund bigint,
    lease_owner uuid,
    lease_expires_at timestamp with time zone,
    attempts integer DEFAULT 1 NOT NULL,
    created_at timestamp with time zone NOT NULL,
    updated_at timestamp with time zone NOT NULL,
    finished_at timestamp with time zone,
    refunded_at timestamp with time zone,
    processor text NOT NULL,
    processor_status text,
    next_check_at timestamp with time zone,
    checks integer DEFAULT 0 NOT NULL,
    create_key_series integer DEFAULT 0 NOT NULL,
    confirm_key_series integer DEFAULT 0 NOT NULL,
    cancel_key_series integer DEFAULT 0 NOT NULL,
    refund_key_series integer DEFAULT 0 NOT NULL,
    refund_status text,
    refund_failure_code text,
    refund_requested_at timestamp with time zone,
    CONSTRAINT top_ups_refund_check CHECK (((refund_state IS NULL) OR ((status)::text = ANY (ARRAY['succeeded'::text, 'refunded'::text])))),
    CONSTRAINT top_ups_refunded_check CHECK ((((status)::text = 'refunded'::text) = (NOT ((refund_state)::text IS DISTINCT FROM 'refunded'::text)))),
    CONSTRAINT top_ups_succeeded_check CHECK ((((status)::text = ANY (ARRAY['succeeded'::text, 'refunded'::text])) = (balance_after IS NOT NULL)))
);


--
-- Name: COLUMN top_ups.processor; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON COLUMN public.top_ups.processor IS 'the processor the top-up was made with: its ONCEPAY_PROCESSOR_NAME (before V23: its URL)';


--
-- Name: COLUMN top_ups.processor_status; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON COLUMN public.top_ups.processor_status IS 'the PaymentIntent''s status when a driver last looked (requires_action, requires_capture, processing while the top-up waits)';


--
-- Name: COLUMN top_ups.next_check_at; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON COLUMN public.top_ups.next_check_at IS 'when the completer looks again at a top-up (or refund) that waits for the processor; NULL: once untouched for ONCEPAY_COMPLETER_AFTER_SECS';


--
-- Name: COLUMN top_ups.checks; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON COLUMN public.top_ups.checks IS 'looks at a waiting status so far (the interval to the next one grows with it)';


--
-- Name: COLUMN top_ups.create_key_series; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON COLUMN public.top_ups.create_key_series IS 'the Idempotency-Key in use for creating the PaymentIntent: 0 is ...-create-intent, n is ...-create-intent-n (moved on after a saved 5xx)';


--
-- Name: COLUMN top_ups.refund_status; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON COLUMN public.top_ups.refund_status IS 'the processor''s refund status when last seen: pending, succeeded, failed, canceled';


--
-- Name: COLUMN top_ups.refund_failure_code; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON COLUMN public.top_ups.refund_failure_code IS 'why the last refund failed (the refund''s failure_reason, or the processor''s error code); the amount was credited back';


--
-- Name: COLUMN top_ups.refund_requested_at; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON COLUMN public.top_ups.refund_requested_at IS 'when the last refund debited the balance';


--
-- Name: transfers; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.transfers (
    tenant_id uuid NOT NULL,
    transfer_id uuid NOT NULL,
    from_account_id text NOT NULL,
    to_account_id text NOT NULL,
    amount public.oncepay_amount NOT NULL,
    from_balance_after public.oncepay_balance NOT NULL,
    to_balance_after public.oncepay_balance NOT NULL,
    idempotency_key text,
    created_at timestamp with time zone NOT NULL,
    CONSTRAINT transfers_accounts_check CHECK ((from_account_id <> to_account_id))
);


--
-- Name: api_keys; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.api_keys (
    tenant_id uuid NOT NULL,
    key_id uuid NOT NULL,
    key_hash bytea NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    last_used_at timestamp with time zone,
    revoked_at timestamp with time zone,
    CONSTRAINT api_keys_key_hash_check CHECK ((octet_length(key_hash) = 32))
);


--
-- Name: idempotency_keys; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.idempotency_keys (
    tenant_id uuid NOT NULL,
    key public.oncepay_idempotency_key NOT NULL,
    fingerprint public.oncepay_fingerprint NOT NULL,
    method public.oncepay_http_method NOT NULL,
    path text NOT NULL,
    status public.oncepay_key_status NOT NULL,
    resource_id text,
    error_code public.oncepay_decline,
    created_at timestamp with time zone NOT NULL,
    expires_at timestamp with time zone NOT NULL,
    operation public.oncepay_operation NOT NULL
)
WITH (fillfactor='90', autovacuum_vacuum_scale_factor='0.02', autovacuum_vacuum_insert_scale_factor='0.05', autovacuum_analyze_scale_factor='0.02', autovacuum_vacuum_cost_delay='1');


--
-- Name: tenants; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.tenants (
    tenant_id uuid NOT NULL,
    name text NOT NULL,
    api_key_hash bytea NOT NULL,
    missing_key_policy text DEFAULT 'reject'::text NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    creation_fingerprint bytea,
    creation_expires_at timestamp with time zone,
    CONSTRAINT tenants_creation_key_check CHECK (((creation_fingerprint IS NULL) = (creation_expires_at IS NULL))),
    CONSTRAINT tenants_missing_key_policy_check CHECK ((missing_key_policy = ANY (ARRAY['reject'::text, 'allow'::text, 'fingerprint'::text]))),
    CONSTRAINT tenants_name_check CHECK ((((octet_length(name) >= 1) AND (octet_length(name) <= 200)) AND (name !~ '[[:cntrl:]]'::text)))
);


--
-- Name: idempotency_key_overview; Type: VIEW; Schema: public; Owner: -
--

CREATE VIEW public.idempotency_key_overview AS
 SELECT k.tenant_id,
    t.name AS tenant_name,
    k.key,
    ((k.key)::text ~~ 'fp:%'::text) AS derived_key,
    k.operation,
    k.method,
    k.path,
    k.status,
    k.resource_id,
    k.error_code,
    k.created_at,
    k.expires_at,
    date_trunc('second'::text, (now() - k.created_at)) AS age,
    GREATEST(date_trunc('second'::text, (k.expires_at - now())), '00:00:00'::interval) AS replay_remaining,
        CASE
            WHEN (k.expires_at > now()) THEN 'live'::text
            WHEN (k.created_at < (now() - public.oncepay_retention())) THEN 'due_for_purge'::text
            ELSE 'expired'::text
        END AS state
   FROM (public.idempotency_keys k
     JOIN public.tenants t USING (tenant_id));


--
-- Name: oncepay_key_retention; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.oncepay_key_retention (
    retention_secs bigint NOT NULL,
    declared_until timestamp with time zone NOT NULL,
    CONSTRAINT oncepay_key_retention_retention_secs_check CHECK ((retention_secs > 0))
);


--
-- Name: webhook_attempts; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.webhook_attempts (
    tenant_id uuid NOT NULL,
    event_id uuid NOT NULL,
    endpoint_id uuid NOT NULL,
    attempt integer NOT NULL,
    started_at timestamp with time zone NOT NULL,
    latency_ms integer NOT NULL,
    status smallint,
    response_head text,
    error text,
    replica text
);


--
-- Name: webhook_deliveries; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.webhook_deliveries (
    tenant_id uuid NOT NULL,
    event_id uuid NOT NULL,
    endpoint_id uuid NOT NULL,
    sequence bigint NOT NULL,
    resource_id text NOT NULL,
    state text DEFAULT 'pending'::text NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    next_attempt_at timestamp with time zone NOT NULL,
    leased_until timestamp with time zone,
    created_at timestamp with time zone NOT NULL,
    finished_at timestamp with time zone,
    last_status smallint,
    last_error text,
    schedule_start integer DEFAULT 0 NOT NULL,
    CONSTRAINT webhook_deliveries_finished_check CHECK (((state = 'pending'::text) = (finished_at IS NULL))),
    CONSTRAINT webhook_deliveries_state_check CHECK ((state = ANY (ARRAY['pending'::text, 'delivered'::text, 'given_up'::text, 'cancelled'::text, 'held'::text])))
)
WITH (fillfactor='80', autovacuum_vacuum_scale_factor='0', autovacuum_vacuum_threshold='5000', autovacuum_vacuum_cost_delay='0');


--
-- Name: COLUMN webhook_deliveries.schedule_start; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON COLUMN public.webhook_deliveries.schedule_start IS 'attempts that do not count against the retry schedule: those made before the delivery was last reopened (resend, recover, enable), after which its schedule starts again, and each attempt lost with its process (its lease ran out unrecorded; V47)';


--
-- Name: webhook_deliveries_sequence_seq; Type: SEQUENCE; Schema: public; Owner: -
--

ALTER TABLE public.webhook_deliveries ALTER COLUMN sequence ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME public.webhook_deliveries_sequence_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);


--
-- Name: webhook_events_sequence_seq; Type: SEQUENCE; Schema: public; Owner: -
--

CREATE SEQUENCE public.webhook_events_sequence_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;


--
-- Name: webhook_events_sequence_seq; Type: SEQUENCE OWNED BY; Schema: public; Owner: -
--

ALTER SEQUENCE public.webhook_events_sequence_seq OWNED BY public.webhook_events.sequence;


--
-- Name: webhook_recovery_progress; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.webhook_recovery_progress (
    tenant_id uuid NOT NULL,
    idempotency_key text NOT NULL,
    fingerprint bytea NOT NULL,
    deliveries bigint NOT NULL,
    updated_at timestamp with time zone NOT NULL
);


--
-- Name: TABLE webhook_recovery_progress; Type: COMMENT; Schema: public; Owner: -
--

COMMENT ON TABLE public.webhook_recovery_progress IS 'what the slices of a keyed recovery not finished yet changed (V51): taken by its keyed transaction, purged with the recoveries otherwise';


--
-- Name: webhook_events sequence; Type: DEFAULT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.webhook_events ALTER COLUMN sequence SET DEFAULT nextval('public.webhook_events_sequence_seq'::regclass);


--
-- Name: accounts accounts_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.accounts
    ADD CONSTRAINT accounts_pkey PRIMARY KEY (tenant_id, account_id);


--
-- Name: api_keys api_keys_key_hash_key; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.api_keys
    ADD CONSTRAINT api_keys_key_hash_key UNIQUE (key_hash);


--
-- Name: api_keys api_keys_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.api_keys
    ADD CONSTRAINT api_keys_pkey PRIMARY KEY (tenant_id, key_id);


--
-- Name: deposits deposits_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.deposits
    ADD CONSTRAINT deposits_pkey PRIMARY KEY (tenant_id, deposit_id);


--
-- Name: idempotency_keys idempotency_keys_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.idempotency_keys
    ADD CONSTRAINT idempotency_keys_pkey PRIMARY KEY (tenant_id, key);


--
-- Name: oncepay_key_retention oncepay_key_retention_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.oncepay_key_retention
    ADD CONSTRAINT oncepay_key_retention_pkey PRIMARY KEY (retention_secs);


--
-- Name: payments payments_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.payments
    ADD CONSTRAINT payments_pkey PRIMARY KEY (tenant_id, payment_id);


--
-- Name: tenants tenants_api_key_hash_key; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.tenants
    ADD CONSTRAINT tenants_api_key_hash_key UNIQUE (api_key_hash);


--
-- Name: tenants tenants_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.tenants
    ADD CONSTRAINT tenants_pkey PRIMARY KEY (tenant_id);


--
-- Name: top_ups top_ups_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.top_ups
    ADD CONSTRAINT top_ups_pkey PRIMARY KEY (tenant_id, top_up_id);


--
-- Name: transfers transfers_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.transfers
    ADD CONSTRAINT transfers_pkey PRIMARY KEY (tenant_id, transfer_id);


--
-- Name: webhook_attempts webhook_attempts_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.webhook_attempts
    ADD CONSTRAINT webhook_attempts_pkey PRIMARY KEY (tenant_id, event_id, endpoint_id, attempt);


--
-- Name: webhook_deliveries webhook_deliveries_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.webhook_deliveries
    ADD CONSTRAINT webhook_deliveries_pkey PRIMARY KEY (tenant_id, event_id, endpoint_id);


--
-- Name: webhook_endpoints webhook_endpoints_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.webhook_endpoints
    ADD CONSTRAINT webhook_endpoints_pkey PRIMARY KEY (tenant_id, endpoint_id);


--
-- Name: webhook_events webhook_events_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.webhook_events
    ADD CONSTRAINT webhook_events_pkey PRIMARY KEY (tenant_id, event_id);


--
-- Name: webhook_recoveries webhook_recoveries_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.webhook_recoveries
    ADD CONSTRAINT webhook_recoveries_pkey PRIMARY KEY (tenant_id, recovery_id);


--
-- Name: webhook_recovery_progress webhook_recovery_progress_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.webhook_recovery_progress
    ADD CONSTRAINT webhook_recovery_progress_pkey PRIMARY KEY (tenant_id, idempotency_key, fingerprint);


--
-- Name: accounts_list_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX accounts_list_idx ON public.accounts USING btree (tenant_id, created_at, account_id);


--
-- Name: idempotency_keys_created_at_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX idempotency_keys_created_at_idx ON public.idempotency_keys USING btree (created_at);


--
-- Name: payments_account_list_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX payments_account_list_idx ON public.payments USING btree (tenant_id, account_id, created_at, payment_id);


--
-- Name: payments_list_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX payments_list_idx ON public.payments USING btree (tenant_id, created_at, payment_id);


--
-- Name: payments_refunded_list_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX payments_refunded_list_idx ON public.payments USING btree (tenant_id, created_at, payment_id) WHERE (refunded_at IS NOT NULL);


--
-- Name: top_ups_list_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX top_ups_list_idx ON public.top_ups USING btree (tenant_id, created_at, top_up_id);


--
-- Name: top_ups_processor_payment; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX top_ups_processor_payment ON public.top_ups USING btree (processor_payment_id) WHERE (processor_payment_id IS NOT NULL);


--
-- Name: top_ups_unfinished; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX top_ups_unfinished ON public.top_ups USING btree (updated_at) WHERE (((status)::text = 'processing'::text) OR ((refund_state)::text = 'debited'::text));


--
-- Name: transfers_from_list_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX transfers_from_list_idx ON public.transfers USING btree (tenant_id, from_account_id, created_at, transfer_id);


--
-- Name: transfers_list_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX transfers_list_idx ON public.transfers USING btree (tenant_id, created_at, transfer_id);


--
-- Name: transfers_to_list_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX transfers_to_list_idx ON public.transfers USING btree (tenant_id, to_account_id, created_at, transfer_id);


--
-- Name: webhook_attempts_list_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX webhook_attempts_list_idx ON public.webhook_attempts USING btree (tenant_id, endpoint_id, started_at, event_id, attempt);


--
-- Name: webhook_deliveries_due_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX webhook_deliveries_due_idx ON public.webhook_deliveries USING btree (tenant_id, endpoint_id, next_attempt_at, sequence) WHERE (state = 'pending'::text);


--
-- Name: webhook_deliveries_endpoint_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX webhook_deliveries_endpoint_idx ON public.webhook_deliveries USING btree (tenant_id, endpoint_id, sequence) WHERE (state = 'pending'::text);


--
-- Name: webhook_deliveries_failed_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX webhook_deliveries_failed_idx ON public.webhook_deliveries USING btree (tenant_id, endpoint_id, created_at) WHERE (state = ANY (ARRAY['given_up'::text, 'cancelled'::text]));


--
-- Name: webhook_deliveries_finished_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX webhook_deliveries_finished_idx ON public.webhook_deliveries USING btree (finished_at) WHERE (finished_at IS NOT NULL);


--
-- Name: webhook_deliveries_held_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX webhook_deliveries_held_idx ON public.webhook_deliveries USING btree (tenant_id, endpoint_id, sequence) WHERE (state = 'held'::text);


--
-- Name: webhook_deliveries_leased_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX webhook_deliveries_leased_idx ON public.webhook_deliveries USING btree (tenant_id, endpoint_id, leased_until) WHERE ((state = 'pending'::text) AND (leased_until IS NOT NULL));


--
-- Name: webhook_deliveries_resource_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX webhook_deliveries_resource_idx ON public.webhook_deliveries USING btree (tenant_id, endpoint_id, resource_id, sequence) WHERE (finished_at IS NULL);


--
-- Name: webhook_events_fan_out_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX webhook_events_fan_out_idx ON public.webhook_events USING btree (sequence) WHERE (awaiting_fan_out IS NOT NULL);


--
-- Name: webhook_events_list_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX webhook_events_list_idx ON public.webhook_events USING btree (tenant_id, created_at, event_id);


--
-- Name: webhook_recoveries_created_idx; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX webhook_recoveries_created_idx ON public.webhook_recoveries USING btree (created_at);


--
-- Name: top_ups top_ups_emit_event; Type: TRIGGER; Schema: public; Owner: -
--

CREATE TRIGGER top_ups_emit_event AFTER UPDATE OF status ON public.top_ups FOR EACH ROW WHEN ((((old.status)::text IS DISTINCT FROM (new.status)::text) AND ((new.status)::text = ANY (ARRAY['succeeded'::text, 'failed'::text, 'refunded'::text])))) EXECUTE FUNCTION public.oncepay_top_up_emit_event();


--
-- Name: accounts accounts_tenant_id_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.accounts
    ADD CONSTRAINT accounts_tenant_id_fkey FOREIGN KEY (tenant_id) REFERENCES public.tenants(tenant_id);


--
-- Name: api_keys api_keys_tenant_id_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.api_keys
    ADD CONSTRAINT api_keys_tenant_id_fkey FOREIGN KEY (tenant_id) REFERENCES public.tenants(tenant_id);


--
-- Name: deposits deposits_account_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.deposits
    ADD CONSTRAINT deposits_account_fkey FOREIGN KEY (tenant_id, account_id) REFERENCES public.accounts(tenant_id, account_id);


--
-- Name: payments payments_account_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.payments
    ADD CONSTRAINT payments_account_fkey FOREIGN KEY (tenant_id, account_id) REFERENCES public.accounts(tenant_id, account_id);


--
-- Name: top_ups top_ups_account_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.top_ups
    ADD CONSTRAINT top_ups_account_fkey FOREIGN KEY (tenant_id, account_id) REFERENCES public.accounts(tenant_id, account_id);


--
-- Name: transfers transfers_from_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.transfers
    ADD CONSTRAINT transfers_from_fkey FOREIGN KEY (tenant_id, from_account_id) REFERENCES public.accounts(tenant_id, account_id);


--
-- Name: transfers transfers_to_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.transfers
    ADD CONSTRAINT transfers_to_fkey FOREIGN KEY (tenant_id, to_account_id) REFERENCES public.accounts(tenant_id, account_id);


--
-- Name: webhook_endpoints webhook_endpoints_tenant_id_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.webhook_endpoints
    ADD CONSTRAINT webhook_endpoints_tenant_id_fkey FOREIGN KEY (tenant_id) REFERENCES public.tenants(tenant_id);
