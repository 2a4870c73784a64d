CREATE OR REPLACE FUNCTION public.oncepay_pay_many(p_items jsonb)
 RETURNS jsonb
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    x jsonb;
    r record;
BEGIN
    IF jsonb_array_length(p_items) = 1 THEN
        x := p_items -> 0;
        SELECT p.outcome, p.decline, p.expires_at, p.resource INTO r
          FROM oncepay_pay((x ->> 'tenant')::uuid, jsonb_populate_record(NULL::oncepay_claim_args, x -> 'claim'),
                           x ->> 'account', (x ->> 'amount')::bigint) AS p;
        RETURN jsonb_build_array(jsonb_build_object('outcome', r.outcome, 'decline', r.decline,
                                                    'expires_at', r.expires_at, 'resource', r.resource));
    END IF;
    RETURN (
        SELECT jsonb_agg(jsonb_build_object('outcome', b.outcome, 'decline', b.decline,
                                            'expires_at', b.expires_at, 'resource', b.resource)
                         ORDER BY b.item)
          FROM oncepay_pay_batch(
                   ARRAY(SELECT (x.i->>'tenant')::uuid FROM jsonb_array_elements(p_items) WITH ORDINALITY AS x(i, n) ORDER BY x.n),
                   ARRAY(SELECT jsonb_populate_record(NULL::oncepay_claim_args, x.i->'claim')
                           FROM jsonb_array_elements(p_items) WITH ORDINALITY AS x(i, n) ORDER BY x.n),
                   ARRAY(SELECT x.i->>'account' FROM jsonb_array_elements(p_items) WITH ORDINALITY AS x(i, n) ORDER BY x.n),
                   ARRAY(SELECT (x.i->>'amount')::bigint FROM jsonb_array_elements(p_items) WITH ORDINALITY AS x(i, n) ORDER BY x.n)
               ) AS b);
END
$function$


