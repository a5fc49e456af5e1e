-- The dedup table at schema version 1, as idemq 0.1.0 made it:
-- `idemq schema --dialect sqlite --no-outbox` at d1d3d96 (the table's shape is unchanged
-- since the store first shipped, da90bde).
CREATE TABLE message_idempotent (
	consumer VARCHAR(128) NOT NULL,
	message_id VARCHAR(128) NOT NULL,
	business_id VARCHAR(64),
	status SMALLINT DEFAULT 0 NOT NULL,
	payload_hash VARCHAR(64),
	result TEXT,
	owner VARCHAR(32),
	lease_until_ms BIGINT,
	attempts INTEGER DEFAULT 1 NOT NULL,
	processed_time DATETIME,
	created_time DATETIME DEFAULT CURRENT_TIMESTAMP NOT NULL,
	PRIMARY KEY (consumer, message_id)
);

CREATE INDEX ix_message_idempotent_status_time ON message_idempotent (status, processed_time);
