// Package schemadump writes schema idem as the migrations leave it, one
// file per object (sql/schema/), and compares a database with those files.
//
// The text comes from PostgreSQL's own deparsers (pg_get_functiondef,
// pg_get_indexdef, pg_get_constraintdef, pg_get_triggerdef, format_type,
// pg_get_expr) read in a session whose search_path, DateStyle, TimeZone and
// IntervalStyle Dump sets itself, so the output names every object with its
// schema and does not depend on the caller's settings. It holds no OIDs, no
// owner names and no dates: the monthly partitions that the migrations
// create for the month they run in are left out (the default partition,
// which every installation has, is kept), and so are privileges held by
// the owner of an object, who is whoever ran the migrations.
package schemadump

import (
	"context"
	"database/sql"
	"fmt"
	"regexp"
	"sort"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/migrate"
)

// Schema is the schema dumped.
const Schema = "idem"

// RegenerateHint is what to run when the committed files are stale.
const RegenerateHint = "make schema"

// sessionSettings make the deparsers' output independent of the caller's
// session. The search_path is pg_catalog alone, so every idem object is
// written with its schema and no catalog type or function is.
const sessionSettings = `SELECT pg_catalog.set_config('search_path', 'pg_catalog', false),
       pg_catalog.set_config('DateStyle', 'ISO, YMD', false),
       pg_catalog.set_config('TimeZone', 'UTC', false),
       pg_catalog.set_config('IntervalStyle', 'postgres', false),
       pg_catalog.set_config('extra_float_digits', '1', false)`

// Dump returns schema idem of the database conn is connected to, as a map
// from a file's path relative to sql/schema/ (for example
// "functions/claim.sql") to its content. It changes conn's session
// settings (see sessionSettings).
func Dump(ctx context.Context, conn *pgx.Conn) (map[string]string, error) {
	if _, err := conn.Exec(ctx, sessionSettings); err != nil {
		return nil, fmt.Errorf("schemadump: session settings: %w", err)
	}
	out := map[string]string{}
	steps := []struct {
		what string
		fn   func(context.Context, *pgx.Conn, map[string]string) error
	}{
		{"schema", dumpSchema},
		{"types", dumpTypes},
		{"sequences", dumpSequences},
		{"tables", dumpTables},
		{"views", dumpViews},
		{"indexes", dumpIndexes},
		{"routines", dumpRoutines},
		{"triggers", dumpTriggers},
	}
	for _, s := range steps {
		if err := s.fn(ctx, conn, out); err != nil {
			return nil, fmt.Errorf("schemadump: %s: %w", s.what, err)
		}
	}
	for k, v := range out {
		out[k] = strings.TrimRight(v, "\n") + "\n"
	}
	return out, nil
}

// add appends text to file path (objects that share a file, such as a
// function's overloads, are written in a stable order by the caller).
func add(out map[string]string, path, text string) {
	if prev, ok := out[path]; ok {
		out[path] = prev + "\n" + text
		return
	}
	out[path] = text
}

// kept is the condition on pg_class c that leaves out the monthly
// partitions of idem.processed_events and their indexes (their names and
// bounds are the month the migrations ran in), and goose's version table.
const keptRelation = `c.relnamespace = 'idem'::regnamespace
  AND c.relname <> 'goose_db_version'
  AND NOT (c.relispartition AND pg_catalog.pg_get_expr(c.relpartbound, c.oid) <> 'DEFAULT')`

// grants returns GRANT statements for the privileges in acl held by roles
// other than owner, sorted; on is the object as GRANT names it
// ("TABLE idem.policies", "FUNCTION idem.claim(text, ...)").
func grants(ctx context.Context, conn *pgx.Conn, aclQuery string, args ...any) ([]string, error) {
	rows, err := conn.Query(ctx, aclQuery, args...)
	if err != nil {
		return nil, err
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	sort.Strings(lines)
	return lines, nil
}

// aclGrants is the query shape grants runs: $1 is the object's OID
// expression's value, the SELECT yields one GRANT per (privilege, grantee).
func aclGrants(from, on string) string {
	return `SELECT 'GRANT ' || a.privilege_type || ' ON ` + on + ` TO ' ||
	               CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(a.grantee)) END ||
	               CASE WHEN a.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END || ';'
	          FROM ` + from + `
	         WHERE a.grantee <> o.owner`
}

func comment(ctx context.Context, conn *pgx.Conn, what string, oid uint32, catalog string) (string, error) {
	var c *string
	if err := conn.QueryRow(ctx, `SELECT pg_catalog.obj_description($1::oid, $2)`, oid, catalog).Scan(&c); err != nil {
		return "", err
	}
	if c == nil {
		return "", nil
	}
	var lit string
	if err := conn.QueryRow(ctx, `SELECT pg_catalog.quote_literal($1)`, *c).Scan(&lit); err != nil {
		return "", err
	}
	return "COMMENT ON " + what + " IS " + lit + ";\n", nil
}

func dumpSchema(ctx context.Context, conn *pgx.Conn, out map[string]string) error {
	var b strings.Builder
	b.WriteString("CREATE SCHEMA idem;\n")
	g, err := grants(ctx, conn, aclGrants(`pg_catalog.pg_namespace n,
	       LATERAL (SELECT n.nspowner AS owner) o,
	       LATERAL pg_catalog.aclexplode(n.nspacl) a`, "SCHEMA idem")+` AND n.nspname = 'idem'`)
	if err != nil {
		return err
	}
	writeGrants(&b, g)
	// Default privileges set in schema idem (FOR ROLE is the role that
	// creates the objects: left out, as the owner is).
	rows, err := conn.Query(ctx, `
		SELECT 'ALTER DEFAULT PRIVILEGES IN SCHEMA idem ' ||
		       CASE WHEN a.privilege_type IS NULL THEN 'REVOKE ALL' ELSE 'GRANT ' || a.privilege_type END ||
		       ' ON ' || CASE d.defaclobjtype WHEN 'r' THEN 'TABLES' WHEN 'S' THEN 'SEQUENCES' WHEN 'f' THEN 'FUNCTIONS'
		                                      WHEN 'T' THEN 'TYPES' ELSE 'SCHEMAS' END ||
		       ' TO ' || CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(a.grantee)) END || ';'
		  FROM pg_catalog.pg_default_acl d, LATERAL pg_catalog.aclexplode(d.defaclacl) a
		 WHERE d.defaclnamespace = 'idem'::regnamespace AND a.grantee <> d.defaclrole`)
	if err != nil {
		return err
	}
	defs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	sort.Strings(defs)
	writeGrants(&b, defs)
	out["schema.sql"] = b.String()
	return nil
}

func writeGrants(b *strings.Builder, lines []string) {
	if len(lines) == 0 {
		return
	}
	b.WriteString("\n")
	for _, l := range lines {
		b.WriteString(l + "\n")
	}
}

func dumpTypes(ctx context.Context, conn *pgx.Conn, out map[string]string) error {
	rows, err := conn.Query(ctx, `
		SELECT t.typname,
		       CASE t.typtype
		         WHEN 'e' THEN 'CREATE TYPE idem.' || pg_catalog.quote_ident(t.typname) || ' AS ENUM (' ||
		              (SELECT pg_catalog.string_agg(pg_catalog.quote_literal(e.enumlabel), ', ' ORDER BY e.enumsortorder)
		                 FROM pg_catalog.pg_enum e WHERE e.enumtypid = t.oid) || ');'
		         WHEN 'd' THEN 'CREATE DOMAIN idem.' || pg_catalog.quote_ident(t.typname) || ' AS ' ||
		              pg_catalog.format_type(t.typbasetype, t.typtypmod) ||
		              CASE WHEN t.typnotnull THEN ' NOT NULL' ELSE '' END ||
		              COALESCE((SELECT pg_catalog.string_agg(' CONSTRAINT ' || pg_catalog.quote_ident(c.conname) || ' ' ||
		                                pg_catalog.pg_get_constraintdef(c.oid), '' ORDER BY c.conname)
		                          FROM pg_catalog.pg_constraint c WHERE c.contypid = t.oid), '') || ';'
		         WHEN 'c' THEN 'CREATE TYPE idem.' || pg_catalog.quote_ident(t.typname) || ' AS (' ||
		              (SELECT pg_catalog.string_agg(pg_catalog.quote_ident(a.attname) || ' ' ||
		                                            pg_catalog.format_type(a.atttypid, a.atttypmod), ', ' ORDER BY a.attnum)
		                 FROM pg_catalog.pg_attribute a WHERE a.attrelid = t.typrelid AND a.attnum > 0 AND NOT a.attisdropped) || ');'
		       END
		  FROM pg_catalog.pg_type t
		 WHERE t.typnamespace = 'idem'::regnamespace
		   AND (t.typtype IN ('e', 'd') OR (t.typtype = 'c' AND (SELECT c.relkind FROM pg_catalog.pg_class c WHERE c.oid = t.typrelid) = 'c'))
		 ORDER BY t.typname`)
	if err != nil {
		return err
	}
	type typ struct{ Name, Def string }
	ts, err := pgx.CollectRows(rows, pgx.RowToStructByPos[typ])
	if err != nil {
		return err
	}
	for _, t := range ts {
		out["types/"+t.Name+".sql"] = t.Def + "\n"
	}
	return nil
}

func dumpSequences(ctx context.Context, conn *pgx.Conn, out map[string]string) error {
	rows, err := conn.Query(ctx, `
		SELECT c.oid, c.relname,
		       'CREATE SEQUENCE idem.' || pg_catalog.quote_ident(c.relname) ||
		       ' AS ' || pg_catalog.format_type(s.seqtypid, NULL) ||
		       ' START WITH ' || s.seqstart || ' INCREMENT BY ' || s.seqincrement ||
		       ' MINVALUE ' || s.seqmin || ' MAXVALUE ' || s.seqmax || ' CACHE ' || s.seqcache ||
		       CASE WHEN s.seqcycle THEN ' CYCLE' ELSE ' NO CYCLE' END || ';'
		  FROM pg_catalog.pg_class c JOIN pg_catalog.pg_sequence s ON s.seqrelid = c.oid
		 WHERE `+keptRelation+` AND c.relkind = 'S'
		   AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_depend d WHERE d.objid = c.oid AND d.deptype = 'i')
		 ORDER BY c.relname`)
	if err != nil {
		return err
	}
	type seq struct {
		OID       uint32
		Name, Def string
	}
	ss, err := pgx.CollectRows(rows, pgx.RowToStructByPos[seq])
	if err != nil {
		return err
	}
	for _, s := range ss {
		text, err := relationExtras(ctx, conn, s.OID, "SEQUENCE idem."+quoteIdent(s.Name), s.Def+"\n")
		if err != nil {
			return err
		}
		out["sequences/"+s.Name+".sql"] = text
	}
	return nil
}

// relationExtras appends a relation's comment and grants to def.
func relationExtras(ctx context.Context, conn *pgx.Conn, oid uint32, what, def string) (string, error) {
	var b strings.Builder
	b.WriteString(def)
	c, err := comment(ctx, conn, what, oid, "pg_class")
	if err != nil {
		return "", err
	}
	if c != "" {
		b.WriteString("\n" + c)
	}
	on := what
	if strings.HasPrefix(what, "VIEW ") {
		on = "TABLE " + strings.TrimPrefix(what, "VIEW ")
	}
	g, err := grants(ctx, conn, aclGrants(`pg_catalog.pg_class c,
	       LATERAL (SELECT c.relowner AS owner) o,
	       LATERAL pg_catalog.aclexplode(c.relacl) a`, on)+` AND c.oid = $1`, oid)
	if err != nil {
		return "", err
	}
	writeGrants(&b, g)
	return b.String(), nil
}

// quoteIdent quotes s as PostgreSQL's quote_ident does for idem's names:
// only when it is not a plain lower-case identifier.
func quoteIdent(s string) string {
	if plainIdent.MatchString(s) {
		return s
	}
	return pgx.Identifier{s}.Sanitize()
}

var plainIdent = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)

func dumpTables(ctx context.Context, conn *pgx.Conn, out map[string]string) error {
	rows, err := conn.Query(ctx, `
		SELECT c.oid, c.relname, c.relkind = 'p', c.relrowsecurity, c.relforcerowsecurity,
		       c.relpersistence = 'u',
		       CASE WHEN c.relkind = 'p' THEN pg_catalog.pg_get_partkeydef(c.oid) END,
		       CASE WHEN c.relispartition THEN
		         (SELECT 'idem.' || pg_catalog.quote_ident(p.relname) FROM pg_catalog.pg_inherits i
		            JOIN pg_catalog.pg_class p ON p.oid = i.inhparent WHERE i.inhrelid = c.oid) END,
		       CASE WHEN c.relispartition THEN pg_catalog.pg_get_expr(c.relpartbound, c.oid) END,
		       COALESCE(pg_catalog.array_to_string(c.reloptions, ', '), '')
		  FROM pg_catalog.pg_class c
		 WHERE `+keptRelation+` AND c.relkind IN ('r', 'p')
		 ORDER BY c.relname`)
	if err != nil {
		return err
	}
	type table struct {
		OID                           uint32
		Name                          string
		Partitioned, RLS, ForceRLS    bool
		Unlogged                      bool
		PartKey, PartOf, Bound, RelOp *string
	}
	ts, err := pgx.CollectRows(rows, pgx.RowToStructByPos[table])
	if err != nil {
		return err
	}
	for _, t := range ts {
		name := "idem." + quoteIdent(t.Name)
		var b strings.Builder
		b.WriteString("CREATE ")
		if t.Unlogged {
			b.WriteString("UNLOGGED ")
		}
		b.WriteString("TABLE " + name)
		if t.PartOf != nil {
			b.WriteString(" PARTITION OF " + *t.PartOf)
		}
		cols, err := columns(ctx, conn, t.OID, t.PartOf != nil)
		if err != nil {
			return err
		}
		if len(cols) > 0 {
			b.WriteString(" (\n    " + strings.Join(cols, ",\n    ") + "\n)")
		} else if t.PartOf == nil {
			b.WriteString(" ()")
		}
		if t.Bound != nil {
			b.WriteString(" " + *t.Bound)
		}
		if t.PartKey != nil {
			b.WriteString(" PARTITION BY " + *t.PartKey)
		}
		if t.RelOp != nil && *t.RelOp != "" {
			b.WriteString(" WITH (" + *t.RelOp + ")")
		}
		b.WriteString(";\n")
		crows, err := conn.Query(ctx, `
			SELECT 'ALTER TABLE ONLY '||$2||' ADD CONSTRAINT ' || pg_catalog.quote_ident(k.conname) || ' ' ||
			       pg_catalog.pg_get_constraintdef(k.oid) || ';'
			  FROM pg_catalog.pg_constraint k
			 WHERE k.conrelid = $1 AND (k.coninhcount = 0 OR k.contype <> 'c')
			 ORDER BY k.contype, k.conname`, t.OID, name)
		if err != nil {
			return err
		}
		cons, err := pgx.CollectRows(crows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		if t.PartOf != nil {
			cons = nil // a partition's constraints are its parent's
		}
		writeGrants(&b, cons)
		if t.RLS {
			b.WriteString("\nALTER TABLE " + name + " ENABLE ROW LEVEL SECURITY;\n")
		}
		if t.ForceRLS {
			b.WriteString("ALTER TABLE " + name + " FORCE ROW LEVEL SECURITY;\n")
		}
		prows, err := conn.Query(ctx, `
			SELECT 'CREATE POLICY ' || pg_catalog.quote_ident(p.polname) || ' ON '||$2||
			       CASE WHEN p.polpermissive THEN '' ELSE ' AS RESTRICTIVE' END ||
			       ' FOR ' || CASE p.polcmd WHEN 'r' THEN 'SELECT' WHEN 'a' THEN 'INSERT' WHEN 'w' THEN 'UPDATE'
			                                WHEN 'd' THEN 'DELETE' ELSE 'ALL' END ||
			       ' TO ' || (SELECT pg_catalog.string_agg(CASE WHEN r = 0 THEN 'PUBLIC' ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(r)) END, ', ' ORDER BY 1)
			                    FROM pg_catalog.unnest(p.polroles) r) ||
			       COALESCE(' USING (' || pg_catalog.pg_get_expr(p.polqual, p.polrelid) || ')', '') ||
			       COALESCE(' WITH CHECK (' || pg_catalog.pg_get_expr(p.polwithcheck, p.polrelid) || ')', '') || ';'
			  FROM pg_catalog.pg_policy p WHERE p.polrelid = $1 ORDER BY p.polname`, t.OID, name)
		if err != nil {
			return err
		}
		pols, err := pgx.CollectRows(prows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		writeGrants(&b, pols)
		text, err := relationExtras(ctx, conn, t.OID, "TABLE "+name, b.String())
		if err != nil {
			return err
		}
		ccom, err := columnComments(ctx, conn, t.OID, name)
		if err != nil {
			return err
		}
		out["tables/"+t.Name+".sql"] = text + ccom
	}
	return nil
}

// columns renders a table's columns (a partition's only when they differ
// from its parent's: none do in idem).
func columns(ctx context.Context, conn *pgx.Conn, oid uint32, partition bool) ([]string, error) {
	if partition {
		return nil, nil
	}
	rows, err := conn.Query(ctx, `
		SELECT pg_catalog.quote_ident(a.attname) || ' ' || pg_catalog.format_type(a.atttypid, a.atttypmod) ||
		       CASE WHEN a.attcollation <> t.typcollation AND a.attcollation <> 0
		            THEN ' COLLATE ' || pg_catalog.quote_ident(co.collname) ELSE '' END ||
		       CASE a.attidentity WHEN 'a' THEN ' GENERATED ALWAYS AS IDENTITY' WHEN 'd' THEN ' GENERATED BY DEFAULT AS IDENTITY' ELSE '' END ||
		       CASE WHEN a.attgenerated = 's' THEN ' GENERATED ALWAYS AS (' || pg_catalog.pg_get_expr(d.adbin, d.adrelid) || ') STORED'
		            WHEN d.adbin IS NOT NULL THEN ' DEFAULT ' || pg_catalog.pg_get_expr(d.adbin, d.adrelid) ELSE '' END ||
		       CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END
		  FROM pg_catalog.pg_attribute a
		  JOIN pg_catalog.pg_type t ON t.oid = a.atttypid
		  LEFT JOIN pg_catalog.pg_collation co ON co.oid = a.attcollation
		  LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
		 WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped
		 ORDER BY a.attnum`, oid)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

func columnComments(ctx context.Context, conn *pgx.Conn, oid uint32, name string) (string, error) {
	rows, err := conn.Query(ctx, `
		SELECT 'COMMENT ON COLUMN '||$2||'.' || pg_catalog.quote_ident(a.attname) || ' IS ' ||
		       pg_catalog.quote_literal(pg_catalog.col_description(a.attrelid, a.attnum)) || ';'
		  FROM pg_catalog.pg_attribute a
		 WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped
		   AND pg_catalog.col_description(a.attrelid, a.attnum) IS NOT NULL
		 ORDER BY a.attnum`, oid, name)
	if err != nil {
		return "", err
	}
	cs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(cs) == 0 {
		return "", err
	}
	return "\n" + strings.Join(cs, "\n") + "\n", nil
}

func dumpViews(ctx context.Context, conn *pgx.Conn, out map[string]string) error {
	rows, err := conn.Query(ctx, `
		SELECT c.oid, c.relname, c.relkind = 'm', pg_catalog.pg_get_viewdef(c.oid, true)
		  FROM pg_catalog.pg_class c
		 WHERE `+keptRelation+` AND c.relkind IN ('v', 'm')
		 ORDER BY c.relname`)
	if err != nil {
		return err
	}
	type view struct {
		OID  uint32
		Name string
		Mat  bool
		Def  string
	}
	vs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[view])
	if err != nil {
		return err
	}
	for _, v := range vs {
		kind := "VIEW"
		if v.Mat {
			kind = "MATERIALIZED VIEW"
		}
		name := "idem." + quoteIdent(v.Name)
		text, err := relationExtras(ctx, conn, v.OID, kind+" "+name,
			"CREATE "+kind+" "+name+" AS\n"+strings.TrimRight(v.Def, ";\n")+";\n")
		if err != nil {
			return err
		}
		out["views/"+v.Name+".sql"] = text
	}
	return nil
}

func dumpIndexes(ctx context.Context, conn *pgx.Conn, out map[string]string) error {
	rows, err := conn.Query(ctx, `
		SELECT c.relname, pg_catalog.pg_get_indexdef(c.oid) || ';'
		  FROM pg_catalog.pg_class c JOIN pg_catalog.pg_index i ON i.indexrelid = c.oid
		  JOIN pg_catalog.pg_class t ON t.oid = i.indrelid
		 WHERE `+keptRelation+` AND c.relkind IN ('i', 'I')
		   AND t.relname <> 'goose_db_version'
		   AND NOT (t.relispartition AND pg_catalog.pg_get_expr(t.relpartbound, t.oid) <> 'DEFAULT')
		   AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_constraint k WHERE k.conindid = c.oid AND k.conrelid = t.oid)
		 ORDER BY c.relname`)
	if err != nil {
		return err
	}
	type index struct{ Name, Def string }
	is, err := pgx.CollectRows(rows, pgx.RowToStructByPos[index])
	if err != nil {
		return err
	}
	for _, i := range is {
		out["indexes/"+i.Name+".sql"] = i.Def + "\n"
	}
	return nil
}

func dumpRoutines(ctx context.Context, conn *pgx.Conn, out map[string]string) error {
	rows, err := conn.Query(ctx, `
		SELECT p.oid, p.proname, p.prokind = 'p', pg_catalog.pg_get_function_identity_arguments(p.oid),
		       pg_catalog.pg_get_functiondef(p.oid)
		  FROM pg_catalog.pg_proc p
		 WHERE p.pronamespace = 'idem'::regnamespace AND p.prokind IN ('f', 'p')
		 ORDER BY p.proname, pg_catalog.pg_get_function_identity_arguments(p.oid)`)
	if err != nil {
		return err
	}
	type routine struct {
		OID       uint32
		Name      string
		Procedure bool
		Args, Def string
	}
	rs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[routine])
	if err != nil {
		return err
	}
	for _, r := range rs {
		kind, dir := "FUNCTION", "functions/"
		if r.Procedure {
			kind, dir = "PROCEDURE", "procedures/"
		}
		sig := kind + " idem." + quoteIdent(r.Name) + "(" + r.Args + ")"
		var b strings.Builder
		b.WriteString(strings.TrimRight(r.Def, "\n") + ";\n")
		c, err := comment(ctx, conn, sig, r.OID, "pg_proc")
		if err != nil {
			return err
		}
		if c != "" {
			b.WriteString("\n" + c)
		}
		g, err := grants(ctx, conn, aclGrants(`pg_catalog.pg_proc p,
		       LATERAL (SELECT p.proowner AS owner) o,
		       LATERAL pg_catalog.aclexplode(COALESCE(p.proacl, pg_catalog.acldefault('f', p.proowner))) a`, sig)+` AND p.oid = $1`, r.OID)
		if err != nil {
			return err
		}
		writeGrants(&b, g)
		add(out, dir+r.Name+".sql", b.String())
	}
	return nil
}

func dumpTriggers(ctx context.Context, conn *pgx.Conn, out map[string]string) error {
	rows, err := conn.Query(ctx, `
		SELECT c.relname || '.' || t.tgname, pg_catalog.pg_get_triggerdef(t.oid) || ';'
		  FROM pg_catalog.pg_trigger t JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
		 WHERE `+keptRelation+` AND NOT t.tgisinternal AND t.tgparentid = 0
		 ORDER BY 1`)
	if err != nil {
		return err
	}
	type trigger struct{ Name, Def string }
	ts, err := pgx.CollectRows(rows, pgx.RowToStructByPos[trigger])
	if err != nil {
		return err
	}
	for _, t := range ts {
		out["triggers/"+t.Name+".sql"] = t.Def + "\n"
	}
	return nil
}

// Migrated applies every migration to the empty database db and conn are
// connected to, and dumps it.
func Migrated(ctx context.Context, db *sql.DB, conn *pgx.Conn) (map[string]string, error) {
	if _, err := migrate.Up(ctx, db); err != nil {
		return nil, fmt.Errorf("schemadump: migrate up: %w", err)
	}
	return Dump(ctx, conn)
}
