CREATE OR REPLACE FUNCTION public.oncepay_retention()
 RETURNS interval
 LANGUAGE sql
 STABLE
AS $function$
    SELECT make_interval(secs => coalesce(nullif(current_setting('oncepay.retention_secs', true), '')::int, 604800))
$function$


