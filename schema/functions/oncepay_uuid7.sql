CREATE OR REPLACE FUNCTION public.oncepay_uuid7()
 RETURNS uuid
 LANGUAGE sql
 PARALLEL SAFE
AS $function$
    SELECT encode(set_bit(set_bit(
               substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
               || substring(uuid_send(gen_random_uuid()) FROM 7),
           52, 1), 53, 1), 'hex')::uuid
$function$


